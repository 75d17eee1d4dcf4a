"""Errors of the health monitor's JSON API, in the authorizer's error tree (authorizer.errors):

    AuthorizerError
    └── MonitorOff       503 monitor_off   no health monitor runs for this run (and none wrote to the database lately)

Unknown or malformed peer ids are the authorizer's NotFound (404 not_found).
"""

from __future__ import annotations

from authorizer.errors import AuthorizerError


class MonitorOff(AuthorizerError):
    status, code = 503, "monitor_off"

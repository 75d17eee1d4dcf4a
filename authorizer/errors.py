"""Every error the authorizer answers with, each one an HTTP status and a stable snake_case code.

    AgoraError (protocol.errors)
    ├── ConfigError              bad flags, policy file, key file or database URL (exit code 2)
    └── AuthorizerError          an HTTP request that cannot be served; body {"error": {code, message}}
        ├── InvalidRequest       400 invalid_request     body or path failed validation
        ├── IdentityMismatch     400 identity_mismatch   peer id is not the hash of the public key
        ├── RejectedEvidence     400 evidence_rejected   reported evidence proves nothing (recorded)
        ├── AdminAuthRequired    401 admin_unauthorized  missing or wrong admin bearer token
        ├── ProofRejected        401 bad_proof           join/renew/leave/evidence signature or timestamp is wrong
        ├── ProofRequired        401 proof_required      a join that would replace a live ticket is unsigned
        ├── RenewalRefused       403 renewal_refused     peer is banned, has left or is not admitted
        ├── ReporterNotAdmitted  403 reporter_not_admitted  an evidence reporter holds no live credential
        ├── NotFound             404 not_found           no such route, ticket or peer
        ├── MethodNotAllowed     405 method_not_allowed
        ├── PayloadTooLarge      413 payload_too_large
        ├── RateLimited          429 rate_limited        too many requests from this source; wait Retry-After
        ├── StoreUnavailable     503 store_unavailable   the database did not answer; retry later
        ├── DialerUnavailable    503 reachability_unavailable  the libp2p dialer could not start
        └── InternalError        500 internal            a bug of ours, never the caller's input

Admission rejections are not errors: they are a normal outcome of a join, carried in the ticket
as a `RejectReason` (authorizer.admission) with a sentence telling the user what to do.
Every message here is a sentence telling the caller what to do next.
"""

from __future__ import annotations

import math

from protocol.errors import AgoraError, ConfigError

__all__ = [
    "AuthorizerError", "ConfigError", "InvalidRequest", "IdentityMismatch", "AdminAuthRequired",
    "ProofRejected", "ProofRequired", "RenewalRefused", "ReporterNotAdmitted", "RejectedEvidence", "NotFound",
    "MethodNotAllowed", "PayloadTooLarge", "RateLimited", "StoreUnavailable", "DialerUnavailable", "InternalError",
]


class AuthorizerError(AgoraError):
    """An HTTP request the authorizer refuses; `status` and `code` go on the wire."""

    status = 500
    code = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}

    def headers(self) -> dict[str, str]:
        """Headers the answer carries besides Content-Type."""
        return {}


class InvalidRequest(AuthorizerError):
    status, code = 400, "invalid_request"


class IdentityMismatch(AuthorizerError):
    status, code = 400, "identity_mismatch"


class AdminAuthRequired(AuthorizerError):
    status, code = 401, "admin_unauthorized"


class ProofRejected(AuthorizerError):
    status, code = 401, "bad_proof"


class ProofRequired(AuthorizerError):
    status, code = 401, "proof_required"


class RenewalRefused(AuthorizerError):
    status, code = 403, "renewal_refused"


class ReporterNotAdmitted(AuthorizerError):
    status, code = 403, "reporter_not_admitted"


class RejectedEvidence(AuthorizerError):
    """Evidence that does not prove its case (`reason`, a protocol.authorizer_api.EvidenceReason
    value). It was recorded as report `evidence_id`, and its reporter is flagged there."""

    status, code = 400, "evidence_rejected"  # protocol.authorizer_api.EVIDENCE_REJECTED

    def __init__(self, message: str, *, reason: str, evidence_id: int, accused: str):
        super().__init__(message)
        self.reason, self.evidence_id, self.accused = reason, evidence_id, accused

    def body(self) -> dict:
        error = super().body()["error"]
        return {"error": {**error, "reason": self.reason, "evidence_id": self.evidence_id, "accused": self.accused}}


class NotFound(AuthorizerError):
    status, code = 404, "not_found"


class MethodNotAllowed(AuthorizerError):
    status, code = 405, "method_not_allowed"


class PayloadTooLarge(AuthorizerError):
    status, code = 413, "payload_too_large"


class RateLimited(AuthorizerError):
    """A source or a node sent more requests than its token bucket allows (authorizer.ratelimit).
    The answer carries `Retry-After` (whole seconds, at least 1): when a token will be there."""

    status, code = 429, "rate_limited"  # protocol.authorizer_api.RATE_LIMITED (a test pins them equal)

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(retry_after_header(self.retry_after_s))}


def retry_after_header(seconds: float) -> int:
    """Retry-After is whole seconds; never 0, which clients read as "at once" and would spin on."""
    return max(1, math.ceil(seconds))


class StoreUnavailable(AuthorizerError):
    status, code = 503, "store_unavailable"


class DialerUnavailable(AuthorizerError):
    status, code = 503, "reachability_unavailable"


class InternalError(AuthorizerError):
    status, code = 500, "internal"

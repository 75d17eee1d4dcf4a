"""Joining the swarm: start hivemind's DHT with our record validators, reach the initial peers,
and get a P2P handle on the same libp2p daemon for our own streams.

hivemind forks its DHT process, so this runs before the node starts any thread of its own
(forking a multi-threaded process can deadlock, DESIGN §10).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from dataclasses import dataclass
from typing import Optional

import hivemind
from hivemind.utils.auth import AuthorizerBase

from protocol.auth_state import SharedAuthState
from protocol.dht_schema import schema_for_run
from protocol.errors import ConfigError
from protocol.identity import Identity
from protocol.records import SignedRecordValidator

logger = logging.getLogger(__name__)


@dataclass
class SwarmMembership:
    dht: hivemind.DHT
    validator: SignedRecordValidator
    maddrs: list[str]

    def shutdown(self) -> None:
        if self.dht.is_alive():
            self.dht.shutdown()
        self.dht.join(timeout=10)
        if self.dht.is_alive():
            self.dht.kill()


def join_swarm(*, identity: Identity, run_id: str, num_stages: int, initial_peers: list[str],
               host_maddrs: list[str], announce_maddrs: list[str], bootstrap_timeout_s: float,
               client_mode: bool = False, auth_state: Optional[SharedAuthState] = None,
               authorizer: Optional[AuthorizerBase] = None) -> SwarmMembership:
    """Start the DHT and bootstrap. Raises ConfigError (exit 2) if no initial peer answers.
    With `auth_state`, records must carry credentials; `authorizer` checks every DHT RPC."""
    if mp.get_start_method(allow_none=True) != "fork":
        mp.set_start_method("fork", force=True)  # hivemind requires fork (DESIGN §3)
    validator = SignedRecordValidator(identity, schema_for_run(run_id, num_stages), run_id=run_id, auth=auth_state)
    try:
        dht = hivemind.DHT(
            initial_peers=initial_peers or None,
            start=True,
            record_validators=[validator],
            identity_path=identity.path,
            # hivemind's duplicate-identity probe only understands RSA keys; ours are Ed25519
            check_if_identity_free=False,
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs or None,
            client_mode=client_mode,
            authorizer=authorizer,
            bootstrap_timeout=bootstrap_timeout_s,
            startup_timeout=bootstrap_timeout_s,
            daemon=True,
        )
    except Exception as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if initial_peers:
            raise ConfigError(
                f"could not reach any initial peer within {bootstrap_timeout_s:.0f}s ({message}); "
                "check the --initial-peers multiaddrs (they must include /p2p/<peer id>) and that those nodes are up"
            ) from exc
        raise ConfigError(f"could not start the libp2p node on {host_maddrs}: {message}; "
                          "check --host-maddrs") from exc
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    logger.info("joined the swarm as %s (pid %d)", dht.peer_id, os.getpid())
    return SwarmMembership(dht=dht, validator=validator, maddrs=maddrs)

"""Who may average with a replica: a worker of the same stage holding a current, unrevoked run
credential [report 3.6.1.5].

libp2p authenticates the peer id at the other end of a stream; it does not know whether that peer
is in the run at all, let alone a worker of this stage. hivemind's averager answers anyone, so
without this a peer outside the run could join a group, send parts into the average or ask for
state. Each replica therefore puts its signed credential in its round's gathered metadata (the
`gather` its JoinRequest carries and the leader hands every member), and checks, in its averager
process:

- a join request: the credential in the request's metadata (`admit_join`);
- the group its leader assembled, before the all-reduce: every other member's credential in the
  gathered metadata (`check_group`), so a follower refuses a group whose leader or members are not
  workers of the stage (a credentialed trainer can write itself into the averaging keys of the DHT
  as a leader);
- a part or state request: only peers verified by one of the above, until their credential
  expires or is revoked (`is_verified`).

The averager is a forked child: it reads the node's credential and revocation list from the
`SharedAuthState` files, which the node rewrites on renewal and refresh. Refusals are counted by
reason in shared memory created before the fork, so the node's `agora/v1/info` and summary show
them. In an open run (`--insecure-open-run`) there is no credential and nothing is checked.
"""

from __future__ import annotations

import enum
import logging
import multiprocessing as mp
import time
from typing import Optional

from protocol.auth_state import SharedAuthState
from protocol.credentials import MAX_CLOCK_SKEW_S, Credential, CredentialError, verify_credential
from roles.event_log import EventAggregator

logger = logging.getLogger(__name__)

CREDENTIAL_KEY = "credential"
"""The key of a replica's signed credential (bytes) in its round's gathered metadata."""

GROUP_REFUSED = "refused the group"
"""How the reason of a round whose group this replica refused begins. It reaches the node inside
hivemind's MatchmakingException message (the exception crosses the process boundary by its text);
such a round does not count against the replica's health (health/round_health.py): the group was at fault."""


class Refusal(str, enum.Enum):
    """Why an averaging request, or a group, was refused."""

    NO_CREDENTIAL = "no_credential"  # the metadata carries no credential: a peer outside the run
    MALFORMED = "malformed"  # the credential does not decode
    BAD_SIGNATURE = "bad_signature"  # not signed by this run's root key
    UNSUPPORTED_VERSION = "unsupported_version"  # issued by a newer authorizer than we speak
    EXPIRED = "expired"  # past its expiry
    NOT_YET_VALID = "not_yet_valid"  # issued in the future
    WRONG_PEER = "wrong_peer"  # another peer's credential
    WRONG_RUN = "wrong_run"  # another run's credential
    REVOKED = "revoked"  # on the run's revocation list
    WRONG_ROLE = "wrong_role"  # a current credential, but not a worker's (a trainer)
    WRONG_STAGE = "wrong_stage"  # a worker of another stage
    UNVERIFIED = "unverified"  # a part or state request from a peer no join or group of ours verified
    GROUP = "group"  # a group assembled with members that are not workers of this stage (counted once per group)


class AveragingRefused(Exception):
    """A peer may not average with us; `reason` is counted."""

    def __init__(self, reason: Refusal, message: str):
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


class RefusalCounts:
    """Refusals by reason, counted in the averager process and read in the node's: a shared
    array created before the fork."""

    def __init__(self):
        self._reasons = list(Refusal)
        self._array = mp.Array("q", len(self._reasons))

    def add(self, reason: Refusal) -> None:
        with self._array.get_lock():
            self._array[self._reasons.index(reason)] += 1

    def snapshot(self) -> dict[str, int]:
        with self._array.get_lock():
            values = list(self._array)
        return {reason.value: n for reason, n in zip(self._reasons, values) if n}


class AveragingAccess:
    """The credential checks of one replica's averaging (see module docstring). Built in the node
    before the averager forks; `credential_bytes` is read in the node, the rest in the averager."""

    def __init__(self, auth: SharedAuthState, stage: int, *, counts: Optional[RefusalCounts] = None):
        self.auth = auth
        self.stage = stage
        self.counts = counts or RefusalCounts()
        self._verified: dict[str, Credential] = {}
        self._log = EventAggregator(logger, "refused", "averaging request", level=logging.WARNING)

    def credential_bytes(self) -> Optional[bytes]:
        """This node's current signed credential, for its round's gathered metadata."""
        return self.auth.credential_bytes()

    def verify(self, peer_id: str, metadata: object, now: Optional[float] = None) -> Credential:
        """The credential in `peer_id`'s gathered metadata, if it makes `peer_id` a current,
        unrevoked worker of our stage; remembered until it expires. Raises AveragingRefused."""
        credential = metadata.get(CREDENTIAL_KEY) if isinstance(metadata, dict) else None
        if not isinstance(credential, bytes) or not credential:
            raise AveragingRefused(Refusal.NO_CREDENTIAL, f"{peer_id} sent no run credential with its round metadata")
        try:
            verified = verify_credential(self.auth.root_public_key, credential, now=now, peer_id=peer_id,
                                         run_id=self.auth.run_id)
        except CredentialError as exc:
            raise AveragingRefused(Refusal(exc.reason.value), str(exc)) from exc
        if self._revoked(verified):
            raise AveragingRefused(Refusal.REVOKED, f"the credential of {peer_id} is revoked")
        if verified.role != "worker":
            raise AveragingRefused(Refusal.WRONG_ROLE,
                                   f"{peer_id} holds a {verified.role}'s credential, not a worker's")
        if verified.stage != self.stage:
            raise AveragingRefused(Refusal.WRONG_STAGE, f"{peer_id} is a worker of stage {verified.stage}, "
                                                        f"not of stage {self.stage}")
        self._verified[peer_id] = verified
        return verified

    def is_verified(self, peer_id: str, now: Optional[float] = None) -> bool:
        """Did a join request or group of ours verify `peer_id`, with a credential that is still
        current and not revoked?"""
        credential = self._verified.get(peer_id)
        if credential is None:
            return False
        now = time.time() if now is None else now
        if now >= credential.expires_at + MAX_CLOCK_SKEW_S or self._revoked(credential):
            del self._verified[peer_id]
            return False
        return True

    def refuse(self, reason: Refusal, detail: str) -> None:
        """Count a refusal and log it (the first at once, repeats once per interval)."""
        self.counts.add(reason)
        self._log.count(reason.value, detail)

    def refusals(self) -> dict[str, int]:
        return self.counts.snapshot()

    def _revoked(self, credential: Credential) -> bool:
        revocations = self.auth.revocations()
        return revocations is not None and revocations.is_revoked(credential)

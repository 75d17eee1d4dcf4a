"""Joining a run through its authorizer and keeping the credential alive (report 3.6.1).

The node asks to join with its peer id, key and hardware, waits in the queue (showing its
position), and receives a short-lived credential, its stage, the run config and bootstrap peers.
A keeper renews the credential at two thirds of its life, rides out an authorizer outage with
retries until the credential expires, and stops the node with a documented exit code when
renewal is refused or the credential lapses.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Callable, Optional

import httpx
import psutil

from protocol import version
from protocol.credentials import RevocationList, SignedCredential, proof_bytes, renew_at
from protocol.errors import AgoraError, ConfigError
from protocol.identity import Identity

logger = logging.getLogger(__name__)

EXIT_ADMISSION_REJECTED = 4
"""The authorizer turned the node away; the message says what to change."""
EXIT_RENEWAL_REFUSED = 5
"""The authorizer refused to renew the credential (banned, or the run ended for this node)."""
EXIT_CREDENTIAL_EXPIRED = 6
"""The authorizer stayed unreachable until the credential expired."""


class AdmissionRejected(AgoraError):
    exit_code = EXIT_ADMISSION_REJECTED

    def __init__(self, reason: str, message: str):
        super().__init__(f"the authorizer rejected this node ({reason}): {message}")
        self.reason = reason


class CredentialLost(AgoraError):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Admission:
    credential: SignedCredential
    stage: Optional[int]
    run_config: dict
    bootstrap_peers: list[str]
    root_public_key: bytes


def measured_hardware(device: str) -> dict:
    """What the node tells the authorizer about itself. Bandwidth and latency to the run are not
    measured yet: the values are the operator's claims from AGORA_BANDWIDTH_MBPS/AGORA_LATENCY_MS."""
    vram, name = 0, platform.processor() or "cpu"
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        vram, name = int(props.total_memory), props.name
    return {
        "device_name": (name or "cpu")[:128],
        "vram_bytes": vram,
        "ram_bytes": int(psutil.virtual_memory().total),
        "bandwidth_mbps": float(os.environ.get("AGORA_BANDWIDTH_MBPS", "1000")),
        "latency_ms": float(os.environ.get("AGORA_LATENCY_MS", "1")),
    }


class AuthorizerClient:
    """The node's side of the authorizer's /v1 HTTP API."""

    def __init__(self, url: str, *, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)

    async def close(self) -> None:
        await self.http.aclose()

    async def _request(self, method: str, path: str, **kwargs) -> dict:
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ConnectionError(f"authorizer {self.url} unreachable: {exc}") from exc
        try:
            data = response.json()
        except ValueError:
            data = {}
        if response.status_code >= 500:
            raise ConnectionError(f"authorizer {self.url} failed ({response.status_code})")
        if response.status_code >= 400:
            error = data.get("error", {}) if isinstance(data, dict) else {}
            raise AdmissionRejected(error.get("code", str(response.status_code)),
                                    error.get("message", response.text[:300]))
        return data

    def _proof(self, identity: Identity, action: str, run_id: str) -> dict:
        peer_id = identity.peer_id.to_base58()
        signed_at = time.time()
        signature = identity.sign(proof_bytes(action, run_id=run_id, peer_id=peer_id, signed_at=signed_at))
        return {"peer_id": peer_id, "signed_at": signed_at, "signature": base64.b64encode(signature).decode()}

    async def join(self, identity: Identity, role: str, *, hardware: dict, announce_maddrs: list[str],
                   account_token: str = "", stage: Optional[int] = None) -> dict:
        body = {
            "peer_id": identity.peer_id.to_base58(),
            "public_key": base64.b64encode(identity.public_key).decode(),
            "role": role, "hardware": hardware, "client_version": version.client_version(),
            "announce_maddrs": announce_maddrs, "account_token": account_token,
        }
        return await self._request("POST", "/v1/join", json=body)

    async def poll(self, ticket: str) -> dict:
        return await self._request("GET", f"/v1/join/{ticket}")

    async def renew(self, identity: Identity, run_id: str) -> dict:
        return await self._request("POST", "/v1/renew", json=self._proof(identity, "renew", run_id))

    async def leave(self, identity: Identity, run_id: str) -> dict:
        return await self._request("POST", "/v1/leave", json=self._proof(identity, "leave", run_id))

    async def revocations(self) -> RevocationList:
        """The signed revocation list (verified by the caller against the root key)."""
        try:
            response = await self.http.get("/v1/revocations")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ConnectionError(f"authorizer {self.url}: revocations unavailable: {exc}") from exc
        return RevocationList.model_validate_json(response.content)


def _credential_from(payload: dict) -> SignedCredential:
    return SignedCredential.from_bytes(base64.b64decode(payload["credential_msgpack"]))


async def join_run(client: AuthorizerClient, identity: Identity, role: str, *, hardware: dict,
                   announce_maddrs: list[str], account_token: str = "", timeout_s: float = 3600.0,
                   on_wait: Callable[[dict], None] = lambda status: None) -> Admission:
    """Join and wait in the queue until admitted; AdmissionRejected says why not."""
    deadline = time.monotonic() + timeout_s
    retry_s = 1.0
    while True:
        try:
            ticket = await client.join(identity, role, hardware=hardware, announce_maddrs=announce_maddrs,
                                       account_token=account_token)
            break
        except ConnectionError as exc:
            if time.monotonic() > deadline:
                raise ConfigError(f"{exc}; check --authorizer") from exc
            logger.warning("%s; retrying in %.0fs", exc, retry_s)
            await asyncio.sleep(retry_s)
            retry_s = min(retry_s * 2, 30.0)
    while True:
        status = ticket.get("status")
        if status == "admitted":
            admission = ticket["admission"]
            return Admission(
                credential=_credential_from(admission), stage=ticket.get("stage"),
                run_config=ticket.get("run_config") or {}, bootstrap_peers=admission.get("bootstrap_peers", []),
                root_public_key=base64.b64decode(admission["authorizer_public_key"]),
            )
        if status != "queued":
            rejection = ticket.get("rejection") or {}
            raise AdmissionRejected(rejection.get("reason", status or "unknown"),
                                    rejection.get("message", f"ticket ended as {status}; join again"))
        on_wait(ticket)
        if time.monotonic() > deadline:
            raise AdmissionRejected("timeout", f"still queued after {timeout_s:.0f}s; try again later")
        await asyncio.sleep(min(2.0, max(0.2, (ticket.get("estimated_wait_s") or 1.0) / 4)))
        try:
            ticket = await client.poll(ticket["ticket"])
        except ConnectionError as exc:
            logger.warning("%s; still waiting in the queue", exc)


class CredentialKeeper:
    """Renews the credential at two thirds of its life; publishes each new one via `on_renewed`."""

    def __init__(self, client: AuthorizerClient, identity: Identity, run_id: str, credential: SignedCredential,
                 on_renewed: Callable[[SignedCredential], None], *, retry_s: float = 5.0):
        self.client = client
        self.identity = identity
        self.run_id = run_id
        self.credential = credential
        self.on_renewed = on_renewed
        self.retry_s = retry_s
        self.failure: Optional[CredentialLost] = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            wait = max(0.0, renew_at(self.credential.credential) - time.time())
            try:
                await asyncio.wait_for(stop.wait(), wait)
                return
            except asyncio.TimeoutError:
                pass
            await self._renew(stop)
            if self.failure is not None:
                stop.set()
                return

    async def _renew(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                renewed = await self.client.renew(self.identity, self.run_id)
            except AdmissionRejected as exc:
                self.failure = CredentialLost(f"credential renewal refused: {exc}", EXIT_RENEWAL_REFUSED)
                return
            except ConnectionError as exc:
                left = self.credential.credential.expires_at - time.time()
                if left <= 0:
                    self.failure = CredentialLost(
                        f"credential expired while the authorizer was unreachable ({exc})", EXIT_CREDENTIAL_EXPIRED)
                    return
                logger.warning("%s; retrying renewal (credential valid for %.0fs more)", exc, left)
                try:
                    await asyncio.wait_for(stop.wait(), min(self.retry_s, max(left, 0.1)))
                except asyncio.TimeoutError:
                    pass
                continue
            self.credential = _credential_from(renewed)
            self.on_renewed(self.credential)
            logger.info("credential renewed until %s", time.strftime("%H:%M:%S", time.localtime(
                self.credential.credential.expires_at)))
            return

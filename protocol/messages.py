"""Versioned wire records. Every request and reply body on an `agora/v1/*` stream is one of these,
and both sides use the same class: the sender builds the model and sends `to_body(model)`, the
receiver validates what came off the wire with `parse_model`.

Records are frozen pydantic models with strict types. Decoders ignore unknown fields so an older
node keeps working when a newer one adds a field; fields are never renamed or reused. A body
leaves out the optional fields that are None, as hand-built bodies always did, so the bytes an
older node reads are the ones it was written for.

Construction validates too: on a model built from local tensors it costs about as much as
`model_construct` (measured: 11 us against 12 us for a forward request with [128] tokens and
[128, 64] coordinates, dump included), so nothing is gained by skipping it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple, Optional, get_args

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, ValidationError

from protocol.codec import decode_tensor, encode_tensor, unpack
from protocol.errors import ErrorCode, ProtocolError
from protocol.version import PROTOCOL_VERSION, SUPPORTED_PROTOCOL_VERSIONS


def _to_tensor(value: Any) -> Any:
    return value if isinstance(value, torch.Tensor) else decode_tensor(value)


WireTensor = Annotated[torch.Tensor, BeforeValidator(_to_tensor), PlainSerializer(encode_tensor)]
"""A tensor field: decoded from ``{dtype, shape, data}`` on input, encoded back on output."""


class WireModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True, arbitrary_types_allowed=True)


class ErrorBody(WireModel):
    code: int
    message: str = Field(max_length=2048)


class Hello(WireModel):
    """The first frame of every stream, at most HELLO_MAX_BYTES (protocol/stream_limits.py): which
    handler the stream is for and, in authenticated runs, who is calling. The server reads
    nothing else from the stream until the hello checks out (protocol/auth.py)."""

    version: int
    handler: str = Field(max_length=128)
    nonce: bytes = Field(min_length=8, max_length=64)
    timestamp: float
    recipient: Optional[str] = Field(default=None, max_length=128)
    credential: Optional[bytes] = Field(default=None, max_length=2048)
    signature: Optional[bytes] = Field(default=None, max_length=128)


class HelloAck(WireModel):
    """The server's answer to a hello: accepted (signed by the server in authenticated runs, so
    the client knows who serves it) or a typed error, after which the server closes the stream."""

    version: int
    ok: bool
    idle_timeout_s: Optional[float] = None
    """The server closes the stream after this long without a request; clients stop reusing it earlier."""
    max_streams_per_peer: Optional[int] = None
    """Streams the server lets one peer hold open at once; clients keep below it."""
    credential: Optional[bytes] = Field(default=None, max_length=2048)
    signature: Optional[bytes] = Field(default=None, max_length=128)
    error: Optional[ErrorBody] = None


class RequestFrame(WireModel):
    """Every frame after the hello: a request body, numbered. The libp2p channel binds the stream
    to the peer the hello authenticated; the numbers keep replayed or reordered frames out."""

    seq: int = Field(ge=1)
    body: dict


class ReplyFrame(WireModel):
    """The reply to request `seq`: a body, or a typed error."""

    seq: int = Field(ge=0)
    ok: bool
    body: Optional[dict] = None
    error: Optional[ErrorBody] = None


SampleId = Annotated[str, Field(min_length=1, max_length=128)]
Attestation = Annotated[bytes, Field(min_length=64, max_length=64)]
"""An Ed25519 signature over a result (protocol/evidence.py result_signing_bytes)."""
Fingerprint = Annotated[bytes, Field(min_length=8, max_length=8)]
"""Names the weights a result was computed with (roles/worker/serving/compute_stats.py weights_fingerprint)."""
Digest = Annotated[bytes, Field(min_length=32, max_length=32)]
"""A SHA-256 of a tensor as it travels (protocol/evidence.py tensor_digest); 32 zero bytes for none."""


def sample_owner_prefix(trainer_peer_id: str) -> str:
    """How a trainer's sample ids begin: the last 8 characters of its peer id and a dash. A worker
    hands what it kept of a chained sample only to the trainer whose prefix the id carries."""
    return f"{trainer_peer_id[-8:]}-"


class ForwardRequest(WireModel):
    """Run one stage's forward on one sample. The head gets tokens only; later stages also get
    the previous boundary's subspace coordinates [report 4.1]."""

    stage: int = Field(ge=0)
    sample_id: SampleId
    tokens: WireTensor
    coords: Optional[WireTensor] = None


class ForwardReply(WireModel):
    """The stage's output at the boundary: the subspace coordinates for the next stage."""

    coords: WireTensor
    version: Optional[int] = Field(default=None, ge=0)
    """The weight version (steps applied) the output was computed at, for spot checks
    (roles/trainer/spot_checks.py); None from a worker that predates it."""
    weights: Optional[Fingerprint] = None
    """The fingerprint of the weights it was computed with: equal replicas share it."""
    attestation: Optional[Attestation] = None
    """The worker's signature over the output for this input at `version` (protocol/evidence.py)."""


class BackwardRequest(WireModel):
    """Recompute the stage forward from `coords`/`tokens` and backpropagate `grad_output`.
    The tail has no output gradient: its request fuses the loss forward and backward."""

    stage: int = Field(ge=0)
    sample_id: SampleId
    tokens: WireTensor
    coords: Optional[WireTensor] = None
    grad_output: Optional[WireTensor] = None
    step: Optional[int] = Field(default=None, ge=0)
    """The global optimizer step the sample belongs to, as the tail tagged it; absent at the tail
    (which tags) and from older trainers (the worker then tags it itself)."""


class BackwardReply(WireModel):
    """The gradient for the previous stage (absent at the head), the loss (tail only) and the
    step tag."""

    grad_input: Optional[WireTensor] = None
    loss: Optional[float] = None
    step: Optional[int] = Field(default=None, ge=0)
    """The step the sample was accumulated into: the tail's tag, to be carried to the other stages."""
    version: Optional[int] = None
    """The weight version (optimizer steps applied) this stage's gradient was taken at."""
    weights: Optional[Fingerprint] = None
    """The fingerprint of the weights the gradient was taken with."""
    attestation: Optional[Attestation] = None
    """The worker's signature over `grad_input` (protocol/evidence.py)."""
    loss_attestation: Optional[Attestation] = None
    """The tail's signature over `loss`."""


class EvaluateRequest(WireModel):
    """Run one stage's forward on one held-out sample, for evaluation only: the worker computes
    without gradients and counts nothing towards a step, a gate or staleness. Like a forward, the
    head gets tokens only and later stages also get the previous boundary's coordinates."""

    stage: int = Field(ge=0)
    sample_id: SampleId
    tokens: WireTensor
    coords: Optional[WireTensor] = None
    grad_output: Optional[WireTensor] = None
    """With it (a body stage), also the gradient at the input of the output times it, as a backward
    would send but accumulating nothing: how a spot check re-executes a backward."""
    input_grad: bool = False
    """At the tail: also the gradient of the loss at the input coordinates."""
    version: Optional[int] = Field(default=None, ge=0)
    """Compute at this weight version if the worker still holds it (the current one, or the
    previous one a pinned backward used); the reply says which version it used."""


class EvaluateReply(WireModel):
    """The boundary coordinates for the next stage, or at the tail the sample's mean loss; and the
    weight version (optimizer steps applied) the stage computed with."""

    coords: Optional[WireTensor] = None
    loss: Optional[float] = None
    version: int = Field(ge=0)
    grad_input: Optional[WireTensor] = None
    weights: Optional[Fingerprint] = None
    """The fingerprint of the weights it computed with."""
    attestation: Optional[Attestation] = None
    """The worker's signature over what was asked (protocol/evidence.py): the input gradient if
    one was, else the loss at the tail, else the output."""


class AbandonRequest(WireModel):
    """A sample tagged with `step` was dropped before its backward reached this stage."""

    stage: int = Field(ge=0)
    sample_id: SampleId
    step: int = Field(ge=0)


class AbandonReply(WireModel):
    taken: bool
    """False when the step is already closed here (or implausibly far ahead)."""


class RetractRequest(WireModel):
    """Take a sample back out of the step it was accumulated into (`step`, the tail's tag): the
    stage recomputes its parameter gradient from the input it was sent (`tokens`, `coords`) and
    the output gradient it was sent on the backward (`grad_output`; absent at the tail, which
    recomputes its own loss) and subtracts it. Only while the step is open or the next one here
    (roles/worker/serving/retractions.py)."""

    stage: int = Field(ge=0)
    sample_id: SampleId
    step: int = Field(ge=0)
    tokens: WireTensor
    coords: Optional[WireTensor] = None
    grad_output: Optional[WireTensor] = None
    version: Optional[int] = Field(default=None, ge=0)
    """The weight version the sample's backward reported here (`BackwardReply.version`): the
    retraction recomputes on that version's weights while they are kept."""
    accumulated_by: Optional[str] = Field(default=None, min_length=1, max_length=128)
    """The replica that accumulated the sample, when it is not the one asked (it was excluded): the
    one asked takes it out of the stage's step on that replica's behalf, through the gradient
    exchange, and only if that replica's gradients are in the step's sum."""


class RetractReply(WireModel):
    outcome: Literal["applied", "too_late", "ahead", "unsummed"]
    """`applied`: the sample's gradient was subtracted from its step (or, for another replica's
    sample, will be from the stage's sum if that replica's gradients are in it); `too_late`: the
    step is closed here (or this replica already handed its gradients to the stage's exchange),
    nothing changed; `ahead`: this replica has not opened that step yet, nothing changed;
    `unsummed`: another replica's sample, and this stage's replicas do not add up their gradients
    (each steps on its own and averages weights), so it cannot be taken out here."""
    open_step: int = Field(ge=0)
    """The replica's open step when it answered."""


class TagRequest(WireModel):
    """A tail replica asks its stage's tagger for step tags for `count` samples it is about to
    compute."""

    stage: int = Field(ge=0)
    count: int = Field(ge=1, le=65536)
    open_step: Optional[int] = Field(default=None, ge=0)
    """The asker's open step: a replica that has not taken the tagger's step yet gets nothing (its
    samples would run on weights a step old)."""
    ask_id: Optional[int] = Field(default=None, ge=0, lt=1 << 63)
    """Names the ask across its retries: the tagger answers a repeated id with the tags it gave the
    first time, so tags whose reply was lost on the way (a relay died, a slow circuit) are claimed
    by the retry instead of holding their step open until it times out short."""


class TagReply(WireModel):
    """The tags, in order: `counts[i]` samples join `steps[i]`; fewer than asked when the next two
    steps are full (the asker keeps the rest for later). `tagger` is False when the callee does not
    tag for the stage (the asker looks again)."""

    tagger: bool
    steps: list[int] = Field(default_factory=list, max_length=4)
    counts: list[int] = Field(default_factory=list, max_length=4)


class StepCountsRequest(WireModel):
    """A replica's counts for its open step and the next, pushed to the stage's other replicas on
    every change, so they find a step complete without waiting for the DHT."""

    stage: int = Field(ge=0)
    local_step: int = Field(ge=0)
    open_samples: int = Field(ge=0)
    next_samples: int = Field(ge=0)


class StepCountsReply(WireModel):
    pass


class StepCorrection(WireModel):
    """`samples` samples replica `peer` accumulated, taken back out on its behalf: the sum of their
    negated gradients, flat float32 in layout order."""

    peer: str = Field(min_length=1, max_length=128)
    samples: int = Field(ge=1)
    grad: WireTensor


class StepGradientsRequest(WireModel):
    """A replica's contribution to one step of its stage, pushed to the stage's other replicas
    before it steps: the sum of its samples' gradients, flat float32 in layout order (absent when
    it has no samples), and the dropped samples reported to it."""

    stage: int = Field(ge=0)
    step: int = Field(ge=0)
    samples: int = Field(ge=0)
    abandoned: int = Field(default=0, ge=0)
    grad: Optional[WireTensor] = None
    consumed: int = Field(default=0, ge=0)
    """Samples the stage consumed before this step, as the sender counts them (its schedule position)."""
    corrections: list[StepCorrection] = Field(default_factory=list, max_length=8)
    """Samples of other replicas the sender takes back out of the step on their behalf
    (roles/worker/steps/gradient_exchange.py)."""


class StepGradientsReply(WireModel):
    """Empty when taken. When the receiver had already closed the step, `closed` and the sum it
    applied, which the sender then applies as is."""

    closed: bool = False
    samples: int = Field(default=0, ge=0)
    stage_samples: int = Field(default=0, ge=0)
    grad: Optional[WireTensor] = None
    members: list[str] = Field(default_factory=list, max_length=1024)
    consumed: int = Field(default=0, ge=0)


class SparseLoCoFragmentRequest(WireModel):
    """One replica's fragment of a SparseLoCo round, as signed bytes (roles/worker/sparseloco/codec.py
    checks them; the receiver's limit is the fragment's own arithmetic)."""

    stage: int = Field(ge=0)
    round: int = Field(ge=0)
    fragment: int = Field(ge=0)
    data: bytes = Field(max_length=1 << 28)


class SparseLoCoFragmentReply(WireModel):
    """Empty when taken."""

    taken: bool = True


PeerIdText = Annotated[str, Field(min_length=1, max_length=128)]

MAX_CHAIN_STAGES = 64
"""Stages one chained sample may name; far more than any run has."""


class ChainHop(WireModel):
    """One stage of a chained sample's route: the workers to try for it, the trainer's choice
    first (its load-aware balancer), then the others in the order it would pick them."""

    stage: int = Field(ge=0)
    workers: list[PeerIdText] = Field(min_length=1, max_length=8)
    skippable: bool = False
    """A body stage the sample may be routed around when none of `workers` can be reached (the
    run's `skipping:` rules, as the trainer applies them)."""


class SignedHop(WireModel):
    """A worker's signature over one result it passed along a chain, with what the signature covers
    beside the result itself (protocol/evidence.py result_signing_bytes): so that whoever holds the
    result and the sample's tokens can check it, and a trainer can hand the hop to a spot check
    (roles/trainer/chain_checks.py). The kind (output, gradient, loss) is the field it travels in."""

    peer_id: PeerIdText
    """The signer: the worker that computed the result."""
    stage: int = Field(ge=0, le=4096)
    version: int = Field(ge=0)
    """The weight version the result was computed at."""
    weights: Optional[Fingerprint] = None
    coords_digest: Digest
    """The digest of the input coordinates the signer was given (zero bytes at the head)."""
    grad_output_digest: Digest
    """The digest of the output gradient it was given (zero bytes for an output, a loss, the tail)."""
    result_digest: Digest
    """The digest of the result (a loss as protocol/evidence.py loss_tensor): what a neighbour that
    never held the result checks the signature with."""
    attestation: Optional[Attestation] = None
    """None from a worker that does not sign (it still says its version)."""


class ChainRequest(WireModel):
    """Worker-to-worker routing: run this stage's part of a training sample and pass
    its output on to the next stage of `route` yourself. A body or the head forwards, sends its
    coordinates to the next hop, and when the reply comes back runs its own backward with the
    gradient and the step tag in it; the tail fuses loss forward and backward, as for a
    BackwardRequest. `route` lists the stages after this one (a skipped body stage is left out);
    `budget_s` is what is left of the trainer's time for this stage and all after it."""

    stage: int = Field(ge=0)
    sample_id: SampleId
    tokens: WireTensor
    coords: Optional[WireTensor] = None
    route: list[ChainHop] = Field(default_factory=list, max_length=MAX_CHAIN_STAGES)
    budget_s: float = Field(gt=0, le=3600)
    signed: Optional[SignedHop] = None
    """The previous stage's worker's signature over `coords`, its forward output (None from the
    trainer, at the head, and from a worker that predates it)."""
    signed_input: Optional[SignedHop] = None
    """The signature that came with the sender's own input (its previous stage's, over its forward
    output): it binds `signed.coords_digest`, so a sender cannot sign its output over an input it
    was not given (None when the sender is the head)."""


class ChainStage(WireModel):
    """What one stage did with a chained sample."""

    stage: int = Field(ge=0)
    worker: str = Field(default="", max_length=128)
    """The worker that ran it; "" when none of the route's workers for the stage took the sample."""
    version: Optional[int] = Field(default=None, ge=0)
    """The weight version its gradient was taken at (None: it ran no backward)."""
    elapsed_s: float = Field(ge=0)
    """Time the sample spent at this worker, its queues included and the later stages not."""
    failed: list[PeerIdText] = Field(default_factory=list, max_length=8)
    """Workers of this stage tried before `worker` that did not take the sample."""
    skipped: bool = False
    """None of the stage's workers could be reached and the sample went around it."""


class ChainReply(WireModel):
    """The outcome of a chained sample from this stage on. Completed: the loss, the step tag, and
    (to the previous stage's worker) the gradient at this stage's input. Dropped: why, and which
    stages hold a tagged sample that will never get its backward (they are told with an abandon)."""

    stages: list[ChainStage] = Field(default_factory=list, max_length=MAX_CHAIN_STAGES)
    loss: Optional[float] = None
    step: Optional[int] = Field(default=None, ge=0)
    grad_input: Optional[WireTensor] = None
    dropped: Optional[str] = Field(default=None, max_length=64)
    """A SampleDropped reason (`worker_failures`, `backward_failed`, `rejected`, ...); None: completed."""
    detail: str = Field(default="", max_length=2048)
    unreached: list[ChainHop] = Field(default_factory=list, max_length=MAX_CHAIN_STAGES)
    """Of a dropped sample with a step tag: the stages (and workers) whose backward it never
    reached, to be told with an abandon notice; the tail is never among them."""
    signed_grad: Optional[SignedHop] = None
    """The replying stage's signature over `grad_input` (None from a worker that predates it)."""
    signed_output: Optional[SignedHop] = None
    """The replying stage's signature over the forward output it passed on (not at the tail): the
    caller, which knows that stage's input, checks it names that input."""
    signed_grad_output: Optional[SignedHop] = None
    """The signature of the stage after the replying one over the gradient it sent back: binds
    `signed_grad.grad_output_digest` to what that stage signed (not at the tail)."""
    signed_loss: Optional[SignedHop] = None
    """The tail's signature over `loss` (protocol/evidence.py loss_tensor), passed back unchanged
    by every stage before it."""


HopRecordKind = Literal["coords_received", "coords_sent", "gradient_received", "gradient_sent"]
HOP_RECORD_KINDS = get_args(HopRecordKind)
"""What a worker keeps of a chained sample (roles/worker/serving/hop_records.py): the coordinates
it got and passed on, the gradient it got back and sent back."""


class HopRecordRequest(WireModel):
    """A trainer asks a worker what it kept of one of its chained samples: one record, by kind,
    for a spot check of the worker before or after it on the chain (roles/trainer/chain_checks.py)."""

    run_id: str = Field(min_length=1, max_length=128)
    stage: int = Field(ge=0, le=4096)
    sample_id: SampleId
    which: HopRecordKind


class HopRecordReply(WireModel):
    """The kept tensor and its signer's signature over it (None: a signer that does not sign)."""

    tensor: WireTensor
    signed: Optional[SignedHop] = None


class InfoRequest(WireModel):
    pass


class InfoReply(WireModel):
    peer_id: str
    role: str
    stage: Optional[int] = None
    phase: str = "active"
    max_batch: int = 1
    local_step: int = 0
    queued: dict[str, int] = Field(default_factory=dict)
    counters: dict[str, int] = Field(default_factory=dict)
    version: str = ""


def to_body(model: WireModel) -> dict:
    """The msgpack-able body of a request or reply: tensors encoded, None fields left out.

    A record of plain fields (numbers, strings, bytes, tensors: every record on a sample's path)
    is written out directly, in a third of `model_dump`'s time; one with a nested record, a list
    or a map goes through `model_dump`, which gives the same map."""
    body = {}
    for name, value in model.__dict__.items():
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            value = encode_tensor(value)
        elif isinstance(value, (BaseModel, list, tuple, dict)):
            return model.model_dump(exclude_none=True)
        body[name] = value
    return body


def parse_frame(model: type[WireModel], frame: bytes) -> Any:
    """Decode one stream frame (a hello, an ack, a request or a reply) from untrusted bytes.
    A frame of another protocol version is refused with UNSUPPORTED_VERSION, naming the fix."""
    raw = unpack(frame)
    if not isinstance(raw, dict):
        raise ProtocolError(f"{model.__name__} frame must be a map", ErrorCode.MALFORMED_FRAME)
    version = raw.get("version")
    if isinstance(version, int) and version not in SUPPORTED_PROTOCOL_VERSIONS:
        raise ProtocolError(f"protocol version {version} is not supported (this node speaks "
                            f"{PROTOCOL_VERSION}); upgrade the older node", ErrorCode.UNSUPPORTED_VERSION)
    return parse_model(model, raw, ErrorCode.MALFORMED_FRAME)


def _plain_int(value: Any, minimum: int) -> bool:
    return type(value) is int and value >= minimum


class Request(NamedTuple):
    """A request frame as the server reads it (RequestFrame's fields, without building a record)."""

    seq: int
    body: dict


class Reply(NamedTuple):
    """A reply frame as the client reads it (ReplyFrame's fields)."""

    seq: int
    ok: bool
    body: Optional[dict]
    error: Optional[ErrorBody]


def parse_request_frame(frame: bytes) -> Request:
    """`parse_frame(RequestFrame, frame)` for every request of every stream: a well-formed
    envelope (`seq` an int >= 1, `body` a map, no version field) is taken as it is, anything else
    goes through the full validation, which refuses it with the same error as before. Building
    and validating the record (pydantic copies the body map to check it is one) was a fifth of
    our side of a loopback round trip."""
    raw = unpack(frame)
    if type(raw) is dict and "version" not in raw and _plain_int(raw.get("seq"), 1) and type(raw.get("body")) is dict:
        return Request(raw["seq"], raw["body"])
    checked = parse_frame(RequestFrame, frame)
    return Request(checked.seq, checked.body)


def parse_reply_frame(frame: bytes) -> Reply:
    """`parse_frame(ReplyFrame, frame)` for every reply: a successful reply (`ok` true, `seq` an
    int >= 0, `body` a map or absent, no error) is taken as it is; errors and anything odd go
    through the full validation (see parse_request_frame)."""
    raw = unpack(frame)
    if (type(raw) is dict and "version" not in raw and raw.get("ok") is True and raw.get("error") is None
            and _plain_int(raw.get("seq"), 0) and (raw.get("body") is None or type(raw["body"]) is dict)):
        return Reply(raw["seq"], True, raw.get("body"), None)
    checked = parse_frame(ReplyFrame, frame)
    return Reply(checked.seq, checked.ok, checked.body, checked.error)


def parse_model(model: type[WireModel], raw: Any, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> Any:
    """Validate an untrusted body; tensor problems keep their own code."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, ProtocolError):
            raise ProtocolError(f"{'.'.join(map(str, first['loc']))}: {cause}", cause.code) from exc
        where = ".".join(map(str, first["loc"])) or model.__name__
        raise ProtocolError(f"{model.__name__}.{where}: {first['msg']}", code) from exc

"""The provider-neutral model vocabulary: messages, tool specs, stream events and errors.

Every provider (``replica.model``) speaks these types, so the turn loop never sees a vendor's
wire format. Errors, all under ``ReplicaError`` so the service's single catch covers them::

    ModelError               the model call failed; ``retryable`` says whether to try again
    ├── ModelUnavailable     no connection could be made
    ├── ModelTimeout         connect, write or the wait for the next chunk took too long
    ├── ModelHTTPError       the server answered a non-2xx status (``status``, ``retry_after``)
    ├── ModelStreamError     the stream broke off, or the server reported an error inside it
    └── ModelProtocolError   the server sent something that is not a chat-completions stream

Messages name the server by URL (without any user-info) and never carry the API key, the
prompt or the reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias

from replica.errors import ReplicaError

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "tool_calls", "length", "error"]

_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments object."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments object as JSON text, exactly as the model produced it (may be invalid)."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        if self.role not in _ROLES:
            raise ValueError(f"unknown message role {self.role!r}")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, names a tool_call_id")


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEvent:
    call: ToolCall


@dataclass(frozen=True, slots=True)
class Finish:
    reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0


ModelEvent: TypeAlias = TextDelta | ToolCallEvent | Finish


class ModelProvider(Protocol):
    def stream(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *, max_tokens: int
    ) -> AsyncIterator[ModelEvent]:
        """Stream one assistant reply: text deltas and tool calls, then exactly one Finish.

        Raises a ``ModelError`` instead of finishing when the call fails; events already
        yielded stand, so a caller that must not show half a reply buffers until Finish.
        """
        ...

    async def aclose(self) -> None: ...


class ModelError(ReplicaError):
    """A model call failed."""

    retryable: bool = False


class ModelUnavailable(ModelError):
    retryable = True


class ModelTimeout(ModelError):
    retryable = True


class ModelHTTPError(ModelError):
    def __init__(self, message: str, *, status: int, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.retryable = status == 429 or status >= 500


class ModelStreamError(ModelError):
    retryable = True


class ModelProtocolError(ModelError):
    pass

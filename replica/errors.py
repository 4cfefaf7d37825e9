"""The replica's error tree.

Every error the replica raises on purpose derives from :class:`ReplicaError`, and the service
maps each leaf to exactly one HTTP status. A name that breaks the contract's grammar is the
contract's own error, :class:`wire.errors.InvalidName` (400), so a caller that wants "anything a
request can be refused for" catches ``(ReplicaError, WireError)``::

    ReplicaError
    ├── BadRequest             a malformed command, body or query                      -> 400
    ├── Forbidden              the grant verified but does not cover this request      -> 403
    ├── Misdirected            this replica does not mount the session's shard          -> 421
    ├── Unavailable            retry later: at capacity, draining, previous task exiting -> 503
    ├── GrantError             the x-beyond-grant header did not verify                -> 401
    │   ├── GrantMalformed     not a JWT, too large, bad header or encoding
    │   ├── GrantUnknownKid    signed with a key id this replica does not know
    │   ├── GrantBadSignature  the signature does not verify
    │   ├── GrantExpired       past its exp (or missing exp)
    │   ├── GrantBadClaims     wrong aud/iss, missing or malformed claims
    │   └── GrantSealError     the sealed secrets inside cannot be opened
    ├── StoreError             the session store could not do what was asked
    │   ├── LockHeld           another open file description holds the session lock -> 503
    │   ├── LockLost           the lock or its descriptor went away under us (EIO after a lease)
    │   ├── Fenced             this owner was superseded and may never write again
    │   ├── CorruptHistory     a seal, a chain link or a record failed verification
    │   └── StorageUnavailable the shard is missing, read-only or failing
    ├── ConfigError            a flag or file given at start-up is unusable
    ├── ModelError             a model call failed (tree in replica/model_types.py)
    ├── SandboxError           a sandbox exec call failed (tree in replica/sandbox_client.py)
    └── NotifyTokenError       a job-end notify token is malformed or forged (replica/notify.py)

Messages never carry a key, a grant, a token or message text: they are safe to log.
"""

from __future__ import annotations


class ReplicaError(Exception):
    """Base of every deliberate replica error."""


class BadRequest(ReplicaError):
    """A command, body or query the replica cannot use; answered 400 or an error frame."""


class Forbidden(ReplicaError):
    """The grant is genuine but names another session or tenant."""


class Misdirected(ReplicaError):
    """The session's shard is not mounted here: the edge routed it to the wrong slice."""


class Unavailable(ReplicaError):
    """The session cannot be placed here right now; the service answers 503 + Retry-After.

    ``reason`` is the metric label (capacity, draining, exiting, storage)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class GrantError(ReplicaError):
    """The grant did not verify; the service answers 401."""


class GrantMalformed(GrantError):
    pass


class GrantUnknownKid(GrantError):
    pass


class GrantBadSignature(GrantError):
    pass


class GrantExpired(GrantError):
    pass


class GrantBadClaims(GrantError):
    pass


class GrantSealError(GrantError):
    pass


class StoreError(ReplicaError):
    """The session store could not complete an operation."""


class LockHeld(StoreError):
    """The session lock is held by another open file description (usually another replica)."""


class LockLost(StoreError):
    """The descriptor holding the lock failed; the session must be treated as no longer owned."""


class Fenced(StoreError):
    """A successor segment exists: this owner was superseded and must stop writing."""


class CorruptHistory(StoreError):
    """Stored history failed verification: wrong key, moved or altered record, broken chain."""


class StorageUnavailable(StoreError):
    """The shard cannot be used (missing, read-only, or an I/O error)."""


class ConfigError(ReplicaError):
    """Start-up configuration is unusable; the message says which flag and why."""

"""The consistent-hash ring that places a session id on a replica of its slice.

The layout matches the reference edge bit for bit, so this edge and any other implementation of
the contract agree on every owner: replica ``r`` sits at ``h("r#0")`` .. ``h("r#{vnodes-1}")``
with the contract's hash ``h`` (:func:`wire.ring_hash.ring_hash`: FNV-1a, then the splitmix64
finalizer); an id belongs to the replica at the first position at or after ``h(id)``, wrapping
past the top. ``Ring`` takes the hash as a parameter only so a test can show what the ring looks
like without the finalizer; production code always uses ``ring_hash``.

Positions are built once per membership from replica *names*, never URLs, so a replica keeps its
sessions when its address changes. A lookup is one hash plus a bisect over a sorted array;
nothing is cached per id, so memory does not grow with traffic.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from wire.ring_hash import ring_hash

DEFAULT_VNODES = 64

HashFn = Callable[[bytes], int]


@dataclass(frozen=True, slots=True)
class Ring:
    """An immutable ring over a set of replica names; rebuild it when the membership changes.

    Equal positions (vanishingly rare with 64-bit hashes, but possible) are ordered by replica
    name, so every process builds the same ring from the same names in any order.
    """

    replicas: tuple[str, ...]
    vnodes: int = DEFAULT_VNODES
    hash_fn: HashFn = field(default=ring_hash, repr=False)
    _positions: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _owners: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = tuple(self.replicas)
        if not names:
            raise ValueError("a ring needs at least one replica")
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError("replica names must be non-empty strings")
        if len(set(names)) != len(names):
            raise ValueError("replica names in a ring must be unique")
        if not isinstance(self.vnodes, int) or isinstance(self.vnodes, bool) or self.vnodes < 1:
            raise ValueError("vnodes must be a positive integer")
        points = sorted(
            (self.hash_fn(f"{name}#{i}".encode()), name)
            for name in names
            for i in range(self.vnodes)
        )
        # Sorted so that two rings with the same members compare equal whatever the input order.
        object.__setattr__(self, "replicas", tuple(sorted(names)))
        object.__setattr__(self, "_positions", tuple(p for p, _ in points))
        object.__setattr__(self, "_owners", tuple(n for _, n in points))

    @classmethod
    def of(cls, names: Iterable[str], vnodes: int = DEFAULT_VNODES) -> Ring:
        return cls(tuple(names), vnodes)

    def position(self, session_id: str) -> int:
        """The id's point on the ring."""
        return self.hash_fn(session_id.encode())

    def _start(self, session_id: str) -> int:
        i = bisect_left(self._positions, self.position(session_id))
        return 0 if i == len(self._positions) else i

    def owner(self, session_id: str) -> str:
        """The replica the id hashes to: the first position at or after its hash, wrapping."""
        return self._owners[self._start(session_id)]

    def walk(self, session_id: str) -> tuple[str, ...]:
        """Every replica once, clockwise from the id's hash, owner first."""
        start = self._start(session_id)
        owners = self._owners
        total = len(owners)
        want = len(self.replicas)
        seen: dict[str, None] = {}
        # Bounded by one lap of the ring; with every replica present the loop ends far earlier.
        for step in range(total):
            name = owners[(start + step) % total]
            if name not in seen:
                seen[name] = None
                if len(seen) == want:
                    break
        return tuple(seen)

    def shares(self, session_ids: Iterable[str]) -> dict[str, int]:
        """How many of ``session_ids`` each replica owns (every replica listed, zero included)."""
        counts = dict.fromkeys(self.replicas, 0)
        for sid in session_ids:
            counts[self.owner(sid)] += 1
        return counts

"""Admission as a pure decision (edge.core.runtime): shed over the limit, then route; and the
exchange an admitted request carries."""

from __future__ import annotations

from typing import Any

from edge.core.accesslog import AccessRecord
from edge.core.answers import SHED, EdgeAnswer
from edge.core.classify import Kind
from edge.core.metrics import Outcome
from edge.core.runtime import Route, Runtime
from tests.edge.fakes import edge_config, session_with_walk

NAMES = ("r1", "r2", "r3")


def runtime(**options: Any) -> Runtime:
    return Runtime.of(
        edge_config([(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(NAMES)], **options)
    )


def test_a_request_within_the_limit_is_routed_to_its_ring_owner() -> None:
    sid = session_with_walk(NAMES, ["r2"])
    route = runtime(max_concurrent_requests=4).admit(sid, 4)
    assert isinstance(route, Route)
    assert route.owner.name == "r2"
    assert route.slice_config.name == "a07"


def test_over_the_limit_is_shed_before_routing() -> None:
    # An id that would not route is shed all the same: shedding costs no routing work.
    assert runtime(max_concurrent_requests=4).admit("zz9-s1.nonsense", 5) is SHED


def test_an_id_of_no_slice_is_rejected_with_its_own_status() -> None:
    refused = runtime().admit("b01-s1.AAAAAAAAAAAAAAAA", 1)
    assert isinstance(refused, EdgeAnswer)
    assert refused.outcome is Outcome.REJECTED
    assert 400 <= refused.status < 500


def test_routes_are_remembered_per_configuration() -> None:
    rt = runtime()
    sid = session_with_walk(NAMES, ["r1"])
    assert rt.admit(sid, 1) is rt.admit(sid, 1)
    assert sid in rt.routes
    assert sid not in runtime().routes  # a reload starts from nothing


def test_callbacks_get_their_own_retry_policy() -> None:
    rt = runtime()
    sid = session_with_walk(NAMES, ["r3"])
    route = rt.admit(sid, 1)
    assert isinstance(route, Route)
    record = AccessRecord("POST", "/")
    command = rt.exchange(Kind.COMMAND, sid, route, record, 1.0)
    callback = rt.exchange(Kind.CALLBACK, sid, route, record, 1.0)
    assert command.policy is rt.policy
    assert callback.policy is rt.callback_policy
    assert rt.policy != rt.callback_policy
    assert (command.owner.name, command.started, command.record) == ("r3", 1.0, record)

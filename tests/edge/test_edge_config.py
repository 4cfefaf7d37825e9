from __future__ import annotations

from pathlib import Path

import pytest

from edge.core.config import EdgeOptions, load_config, parse_config_text
from edge.core.errors import ConfigError, EdgeError, MalformedSessionId, RoutingError, UnknownSlice
from edge.core.retry import RetryPolicy
from edge.core.ring import Ring
from wire.ring_hash import ring_hash

GOOD = """
[edge]
retry_budget_s = 150
same_target_attempts = 4
retry_jitter = 0.25
min_round_delay_s = 0.5
walk_on_misdirected = false

[[slice]]
name = "a07"
replicas = [
  { name = "r1", url = "http://127.0.0.1:9101" },
  { name = "r2", url = "http://127.0.0.1:9102/" },
  { name = "r3", url = "https://[::1]:9103" },
]

[[slice]]
name = "b2"
replicas = [{ name = "r1", url = "http://127.0.0.1:9201" }]
"""

SLICE = '[[slice]]\nname = "a07"\nreplicas = [{ name = "r1", url = "http://127.0.0.1:9101" }]\n'


def test_good_file(tmp_path: Path) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(GOOD)
    config = load_config(path)
    assert config.options.retry_budget_s == 150.0
    assert config.options.same_target_attempts == 4
    assert config.options.connect_timeout_s == EdgeOptions().connect_timeout_s
    a07 = config.slice_named("a07")
    assert [r.name for r in a07.replicas] == ["r1", "r2", "r3"]
    assert [r.url for r in a07.replicas] == [
        "http://127.0.0.1:9101",
        "http://127.0.0.1:9102",
        "https://[::1]:9103",
    ]
    # The ring is built from names only: the same names anywhere give the same owners.
    assert a07.ring == Ring(("r1", "r2", "r3"))
    sid = "a07-s1.abc123"
    assert [r.name for r in a07.walk(sid)] == list(Ring(("r1", "r2", "r3")).walk(sid))
    assert config.slice_for("b2-x.y").name == "b2"


def test_defaults_and_policies() -> None:
    config = parse_config_text(SLICE)
    assert config.options == EdgeOptions()
    assert config.options.retry_budget_s == 120.0
    assert config.options.retry_policy() == RetryPolicy()
    assert config.options.callback_policy() == RetryPolicy(budget_s=25.0)


def test_options_feed_the_retry_policy() -> None:
    policy = parse_config_text(GOOD).options.retry_policy()
    assert policy == RetryPolicy(
        budget_s=150.0,
        same_target_attempts=4,
        jitter_fraction=0.25,
        min_round_delay_s=0.5,
        walk_on_misdirected=False,
    )


def test_slice_for_errors_map_to_distinct_statuses() -> None:
    config = parse_config_text(GOOD)
    with pytest.raises(UnknownSlice) as unknown:
        config.slice_for("zz9-s1.abc")
    assert unknown.value.status == 404 and unknown.value.slice_name == "zz9"
    for bad in ("", "a07-s1", "a07.abc", "a07-s1.ab/c", "../a07-s1.x", "a07-s1.x.y"):
        with pytest.raises(MalformedSessionId) as malformed:
            config.slice_for(bad)
        assert malformed.value.status == 400
    assert issubclass(MalformedSessionId, RoutingError) and issubclass(UnknownSlice, EdgeError)
    assert not issubclass(UnknownSlice, MalformedSessionId)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("not = [toml", "not valid TOML"),
        ("[edge]\n", "at least one [[slice]]"),
        ("slices = 1\n" + SLICE, "unknown top-level key 'slices'"),
        ("edge = 3\n" + SLICE, "[edge] must be a table"),
        ("[edge]\nretry_budget = 90\n" + SLICE, "unknown key 'retry_budget'"),
        ("[edge]\nretry_budget_s = 0\n" + SLICE, "retry_budget_s must be a number > 0"),
        ("[edge]\nretry_budget_s = 'x'\n" + SLICE, "retry_budget_s"),
        ("[edge]\nretry_budget_s = true\n" + SLICE, "retry_budget_s"),
        ("[edge]\nretry_budget_s = nan\n" + SLICE, "retry_budget_s"),
        ("[edge]\ncallback_budget_s = 30\n" + SLICE, "callback_budget_s"),
        ("[edge]\nsame_target_attempts = 1.5\n" + SLICE, "same_target_attempts must be an int"),
        ("[edge]\nsame_target_attempts = 0\n" + SLICE, "same_target_attempts"),
        ("[edge]\nretry_jitter = 2\n" + SLICE, "retry_jitter"),
        ("[edge]\nvnodes = 0\n" + SLICE, "vnodes"),
        ("[edge]\ncallback_rate_per_session = 21\n" + SLICE, "callback_rate_per_session"),
        ("[edge]\nwalk_on_misdirected = 1\n" + SLICE, "walk_on_misdirected must be true or"),
        ("slice = 'a07'\n", "at least one [[slice]]"),
        ("[[slice]]\nreplicas = []\n", "[[slice]] #1 is missing 'name'"),
        ('[[slice]]\nname = "a-07"\nreplicas = []\n', "[[slice]] #1.name"),
        ('[[slice]]\nname = "a07"\n', "'a07'.replicas must be a non-empty array"),
        ('[[slice]]\nname = "a07"\nreplicas = []\n', "'a07'.replicas must be a non-empty array"),
        ('[[slice]]\nname = "a07"\nweight = 1\nreplicas = []\n', "unknown key 'weight'"),
        ('[[slice]]\nname = "a07"\nreplicas = ["r1"]\n', "replicas[0] must be a table"),
        ('[[slice]]\nname = "a07"\nreplicas = [{ url = "http://h:1" }]\n', "missing 'name'"),
        ('[[slice]]\nname = "a07"\nreplicas = [{ name = "r1" }]\n', "missing 'url'"),
        (SLICE.replace('"r1", url', '"r1", port = 1, url'), "unknown key 'port'"),
        (SLICE.replace('"r1"', '"r 1"'), "replicas[0].name: replica name 'r 1' has ' ' at"),
        (SLICE.replace('"r1"', '"r\\t1"'), "replicas[0].name: replica name 'r\\t1' has '\\t' at"),
        (SLICE.replace('"r1"', '"r\\u0001"'), "replicas[0].name: replica name 'r\\x01' has"),
        (SLICE.replace('"r1"', '"r\\u007f"'), "replicas[0].name: replica name 'r\\x7f' has"),
        (SLICE.replace('"r1"', '"r\u00e9"'), "replicas[0].name: replica name 'r\\xe9' has"),
        (SLICE.replace('"r1"', '""'), "replicas[0].name: replica name is empty"),
        (SLICE.replace('"r1"', '"' + "r" * 256 + '"'), "replicas[0].name: replica name 'rrr"),
        (SLICE.replace('"r1"', '"' + "r" * 256 + '"'), "is 256 bytes long"),
        (SLICE.replace('"r1"', "7"), "replicas[0].name: replica name must be a string"),
        (SLICE.replace("http://127.0.0.1:9101", "ftp://h:1"), "must start with http"),
        (SLICE.replace("http://127.0.0.1:9101", "http://127.0.0.1"), "must name a port"),
        (SLICE.replace("9101", "99999"), "url"),
        (SLICE.replace("9101", "9101/x"), "must not have a path"),
        (SLICE.replace("9101", "9101?a=1"), "must not have a path"),
        (SLICE.replace("9101", "9101?"), "must not have a path"),
        (SLICE.replace("9101", "9101#f"), "must not have a path"),
        (SLICE.replace("http://", "http://u:p@"), "must not carry credentials"),
        (SLICE.replace("http://127.0.0.1:9101", "http://:9101"), "has no host"),
        (SLICE.replace('"http://127.0.0.1:9101"', "9101"), "url must be a string"),
        (
            SLICE.replace("}]", '}, { name = "r1", url = "http://127.0.0.1:9102" }]'),
            "replicas[1].name: 'r1' appears twice",
        ),
        (
            SLICE.replace("}]", '}, { name = "r2", url = "http://127.0.0.1:9101" }]'),
            "replicas[1].url",
        ),
        (SLICE + SLICE, "[[slice]] #2.name: slice 'a07' appears twice"),
    ],
)
def test_bad_files_name_the_key(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config_text(text)
    assert fragment in str(err.value)


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[edge]\nretry_budget_s = -1\n" + SLICE)
    with pytest.raises(ConfigError, match=r"bad\.toml: \[edge\] retry_budget_s"):
        load_config(bad)


@pytest.mark.parametrize("text", [SLICE.replace('"r1"', '"r 1"'), SLICE.replace('"r1"', '""')])
def test_a_refused_replica_name_states_the_rule(text: str) -> None:
    with pytest.raises(ConfigError, match="1-255 bytes of printable ASCII without whitespace"):
        parse_config_text(text)


def test_replicas_named_by_address_are_placed_by_those_bytes() -> None:
    names = ("10.0.4.17:9000", "10.0.4.18:9000", "[fd00::3]:9000", "rack/2/r" + "x" * 247)
    entries = ", ".join(
        f'{{ name = "{name}", url = "http://127.0.0.1:{9101 + i}" }}'
        for i, name in enumerate(names)
    )
    config = parse_config_text(f'[[slice]]\nname = "a07"\nreplicas = [{entries}]\n')
    a07 = config.slice_named("a07")
    assert tuple(r.name for r in a07.replicas) == names  # kept exactly as written
    assert len(names[-1]) == 255
    assert a07.ring == Ring(names)
    # Positions are the ring hash of the name's bytes, "#", the vnode: nothing normalised away.
    expected = sorted(ring_hash(f"{name}#{i}".encode()) for name in names for i in range(64))
    assert list(a07.ring._positions) == expected
    for sid in (f"a07-s1.{i:04d}" for i in range(200)):
        assert tuple(r.name for r in a07.walk(sid)) == Ring(names).walk(sid)


def test_same_replica_name_may_serve_two_slices() -> None:
    config = parse_config_text(GOOD)
    assert config.slice_named("b2").replicas[0].name == "r1"

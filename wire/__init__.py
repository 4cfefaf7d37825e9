"""The contract the edge and the replica both speak, and nothing else.

What belongs here is what both sides must read or write the same way for the fleet to work, so
that it has one definition and neither side imports the other:

- :mod:`wire.names`: the grammar of tenants, slices, shards, session ids and replica names;
- :mod:`wire.errors`: the one error the grammar raises;
- :mod:`wire.http`: paths, query parameters, header names, refusal statuses, ``Retry-After``;
- :mod:`wire.auth`: which ``Authorization`` values make a job-end callback (rule E1), and the
  notify-token prefix;
- :mod:`wire.target`: request-target and query decoding, as the replica's server does it;
- :mod:`wire.ring_hash`: the hash that places session ids and replicas on a ring;
- :mod:`wire.redaction`: which log text carries a credential, and the filter both sides put on
  their log handlers to replace it.

What does not: policy. How the edge builds its ring, retries and walks it, and reads its
configuration; how a replica verifies a grant, mints a notify token or lays sessions out on a
shard: each stays with the side that decides it. Modules here are pure (no I/O, no clock, no
framework; the redaction filter is a standard ``logging.Filter``) and import nothing from
``edge``, ``replica`` or ``fleet_sim``; ``tests/wire/test_wire_boundaries.py`` holds both sides to
that.
"""

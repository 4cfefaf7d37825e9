"""The fleet's L7 edge. Layout by lane (see ARCHITECTURE.md):

- :mod:`edge.core`: what every lane shares: classification, configuration, the ring and the
  retry planner, placement, the exchange and the edge's own answers, headers, the relay loop,
  metrics and the access log;
- :mod:`edge.fast`: the fast lane (plain commands off the socket) and its express exchanges;
- :mod:`edge.aio`: the aiohttp lane (HTTP and event streams, WebSockets, job-end callbacks);
- :mod:`edge.upstream`: the pooled client to replicas;
- :mod:`edge.server`: the serving edge's lifecycle, admission and dispatch to the lanes;
  :mod:`edge.cli`: ``fleet-edge``.
"""

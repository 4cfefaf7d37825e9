"""The fleet's L7 edge. Layout by lane (see ARCHITECTURE.md):

- :mod:`edge.core`: what every lane shares: classification, configuration, the ring and the
  retry planner, placement, the exchange and the edge's own answers, headers, the relay loop,
  metrics and the access log;
- :mod:`edge.fast`: the fast lane (plain commands off the socket) and its express exchanges;
- :mod:`edge.aio`: the aiohttp lane (HTTP and event streams, WebSockets, job-end callbacks);
- :mod:`edge.upstream`: the pooled client to replicas;
- :mod:`edge.dispatch`: admission and the hand-off of each request to its lane;
- :mod:`edge.server`: the serving edge's lifecycle (listeners, reloads, drain);
  :mod:`edge.cli`: ``fleet-edge``.
"""

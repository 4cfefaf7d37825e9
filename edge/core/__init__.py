"""The edge's core: what every lane shares. Classification, configuration, the ring and
the retry planner, placement, the exchange and the edge's own answers, headers, the relay
loop, metrics and the access log.
"""

"""The fast lane: plain commands served straight off the socket (``fastpath``), and the
express exchanges that carry a command without a task (``express``).
"""

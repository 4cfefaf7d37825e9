"""The aiohttp lane: everything the fast lane hands over. Plain HTTP and event streams
(``proxy``), WebSocket sessions (``websocket``) and job-end callbacks (``callbacks``).
"""

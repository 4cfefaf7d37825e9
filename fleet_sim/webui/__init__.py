"""A small web page for people: open a session, send prompts, watch the stream.

``fleet-sim up`` starts the page server next to the fleet (``--web-listen``); the page is plain
HTML and JavaScript with no build step (``static/``). How the browser reaches the edge without
ever holding a grant is explained in :mod:`fleet_sim.webui.server`.
"""

"""BreezeRT's network front: HTTP, WebSocket and WebRTC endpoints over one ``AsyncEngine``.

``breezert.server.app.create_app(engine, serving)`` builds the aiohttp application; ``breezert
serve`` runs it. This package imports nothing itself, so ``breezert.server.protocol`` (the turn
protocol and its error codes) loads with numpy and the standard library only: no aiohttp,
aiortc or torch.
"""

"""BreezeRT's network front: HTTP, WebSocket and WebRTC endpoints over one ``AsyncEngine``.

``breezert.server.app.create_app(engine, serving)`` builds the aiohttp application; ``breezert
serve`` runs it. Importing this package imports nothing else, so ``breezert.server.protocol``
stays usable without aiohttp or torch.
"""

"""BreezeRT's network front: HTTP, WebSocket and WebRTC endpoints over one ``AsyncEngine``.

``create_app(engine, serving)`` builds the aiohttp application; ``breezert serve`` runs it.
"""

from breezert.server.app import create_app

__all__ = ["create_app"]

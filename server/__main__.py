"""`python -m server`: serve the model store over HTTP (settings from TINYSERVE_* variables)."""

import logging

import uvicorn

from server.app import create_app
from server.config import Settings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    # uvicorn's own drain limit outlasts the streams' grace period (server/generation.py: sse_response)
    drain_s = int(settings.shutdown_grace_s) + 5
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, timeout_graceful_shutdown=drain_s)


if __name__ == "__main__":
    main()

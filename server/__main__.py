"""`python -m server`: serve the model store over HTTP (settings from TINYSERVE_* variables)."""

import logging

import uvicorn

from server.app import create_app
from server.config import Settings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()

"""`python -m server`: serve the model store over HTTP.

Every option is a field of `server.config.Settings`: a flag here, a `TINYSERVE_*` variable in the
environment (flags win), one default. Unknown flags are an error, not silently ignored.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn
from pydantic import ValidationError
from pydantic_settings import CliApp, CliSettingsSource

from server.config import Settings


def parse_settings(argv: list[str]) -> Settings:
    env = ", ".join(f"{Settings.model_config['env_prefix']}{name.upper()}" for name in Settings.model_fields)
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="Serve every valid checkpoint of the model store over HTTP (API, demo page, metrics).",
        epilog=f'Each option can also be set in the environment: {env}. Lists: --models a,b or \'["a","b"]\'.',
    )
    source = CliSettingsSource(Settings, root_parser=parser, cli_kebab_case=True, cli_implicit_flags=True)
    try:
        return CliApp.run(Settings, cli_args=argv, cli_settings_source=source)
    except ValidationError as e:  # a value of the right name but the wrong kind: argparse's usage + exit 2
        parser.error(
            "; ".join(f"--{'.'.join(map(str, err['loc'])).replace('_', '-')}: {err['msg']}" for err in e.errors())
        )


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn's own drain limit outlasts the streams' grace period (server/api/routers/sse.py)
    drain_s = int(settings.shutdown_grace_s) + 5
    from server.serving.registry import ModelRegistry

    registry = ModelRegistry(settings)
    registry.begin_loading()  # the weights load while the HTTP layer imports (seconds of a warm start)
    from server.api.app import create_app

    app = create_app(settings, registry)
    uvicorn.run(app, host=settings.host, port=settings.port, timeout_graceful_shutdown=drain_s)


if __name__ == "__main__":
    main()

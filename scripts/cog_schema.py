"""Write `.cog/openapi_schema.json` from predict.py, as `cog build` would, without Docker.

cog's HTTP server (coglet) validates inputs and streams outputs only with this file. The predictor is
inspected by cog's own Python inspector (`cog._inspector.create_predictor`), and every input and
output fragment comes from cog's own type objects (`json_type()`); this script only assembles the
OpenAPI envelope around them (Input, Output, PredictionRequest, PredictionResponse, Status).

    python -m scripts.cog_schema            # writes .cog/openapi_schema.json
    python -m scripts.cog_schema --check    # exits 1 when the committed file is out of date
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = ROOT / ".cog" / "openapi_schema.json"


def input_schema(info) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Input object and the enum components its choice fields refer to."""
    props: dict[str, Any] = {}
    enums: dict[str, Any] = {}
    required = []
    for name, field in info.inputs.items():
        prop: dict[str, Any] = {"x-order": field.order}
        if field.choices is not None:
            enums[name] = {"title": name, "description": "An enumeration.", "enum": list(field.choices)}
            enums[name].update(field.type.primitive.json_type())
            prop["allOf"] = [{"$ref": f"#/components/schemas/{name}"}]
        else:
            prop["title"] = name.replace("_", " ").title()
            prop.update(field.type.json_type())
        if field.default is not None:
            prop["default"] = field.default
        elif not field.type.repetition.name.startswith("OPTIONAL"):  # `X | None = Input(default=None)` may be left out
            required.append(name)
        for key, attr in (
            ("description", "description"),
            ("minimum", "ge"),
            ("maximum", "le"),
            ("minLength", "min_length"),
            ("maxLength", "max_length"),
            ("pattern", "regex"),
            ("deprecated", "deprecated"),
        ):
            if getattr(field, attr) is not None:
                prop[key] = getattr(field, attr)
        props[name] = prop
    schema: dict[str, Any] = {"title": "Input", "type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema, enums


def declares_streaming(module_file: Path, cls: str, method: str) -> bool:
    """Whether `cls.method` carries cog's `@streaming` decorator (a marker that does nothing at run
    time: the cog CLI reads it from the source, so this does too)."""
    tree = ast.parse(module_file.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == method:
                    return any(ast.unparse(d).split(".")[-1].startswith("streaming") for d in fn.decorator_list)
    return False


def declared_concurrency(module_file: Path, cls: str, method: str) -> int:
    """The `max` of `cls.method`'s `@concurrent(max=N)` (an integer literal, read from the source as `cog build`
    reads it into the image's COG_MAX_CONCURRENCY); 1 without one."""
    for node in ast.walk(ast.parse(module_file.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == method:
                    for d in fn.decorator_list:
                        if isinstance(d, ast.Call) and ast.unparse(d.func).split(".")[-1] == "concurrent":
                            return next(k.value.value for k in d.keywords if k.arg == "max")
    return 1


def openapi(info, streaming: bool) -> dict[str, Any]:
    inputs, enums = input_schema(info)
    status = {
        "title": "Status",
        "description": "An enumeration.",
        "type": "string",
        "enum": ["starting", "processing", "succeeded", "canceled", "failed"],
    }
    request = {
        "title": "PredictionRequest",
        "type": "object",
        "properties": {
            "id": {"title": "Id", "type": "string"},
            "created_at": {"title": "Created At", "type": "string", "format": "date-time"},
            "input": {"$ref": "#/components/schemas/Input"},
            "webhook": {"title": "Webhook", "type": "string", "format": "uri", "maxLength": 65536, "minLength": 1},
            "webhook_events_filter": {
                "type": "array",
                "items": {"type": "string", "enum": ["start", "output", "logs", "completed"]},
                "default": ["start", "output", "logs", "completed"],
            },
            "output_file_prefix": {"title": "Output File Prefix", "type": "string"},
        },
    }
    response = {
        "title": "PredictionResponse",
        "type": "object",
        "properties": {
            "id": {"title": "Id", "type": "string"},
            "input": {"$ref": "#/components/schemas/Input"},
            "output": {"$ref": "#/components/schemas/Output"},
            "status": {"$ref": "#/components/schemas/Status"},
            "error": {"title": "Error", "type": "string"},
            "logs": {"title": "Logs", "type": "string", "default": ""},
            "metrics": {"title": "Metrics", "type": "object"},
            "created_at": {"title": "Created At", "type": "string", "format": "date-time"},
            "started_at": {"title": "Started At", "type": "string", "format": "date-time"},
            "completed_at": {"title": "Completed At", "type": "string", "format": "date-time"},
        },
    }
    body = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/PredictionRequest"}}}}
    ok = {
        "description": "Successful Response",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PredictionResponse"}}},
    }
    return {
        "openapi": "3.0.2",
        "info": {"title": "Cog", "version": "0.1.0"},
        "paths": {
            "/predictions": {
                "post": {
                    "summary": "Predict",
                    "operationId": "predict_predictions_post",
                    "requestBody": body,
                    "responses": {"200": ok},
                    "x-cog-streaming": streaming,
                }
            },
            "/predictions/{prediction_id}/cancel": {
                "post": {
                    "summary": "Cancel",
                    "operationId": "cancel_predictions__prediction_id__cancel_post",
                    "responses": {"200": {"description": "Successful Response"}},
                }
            },
            "/health-check": {
                "get": {
                    "summary": "Healthcheck",
                    "operationId": "healthcheck_health_check_get",
                    "responses": {"200": {"description": "Successful Response"}},
                }
            },
        },
        "components": {
            "schemas": {
                "Input": inputs,
                "Output": info.output.json_type(),
                "PredictionRequest": request,
                "PredictionResponse": response,
                "Status": status,
                **enums,
            }
        },
    }


def build(predictor_ref: str = "predict.py:Runner", trainer_ref: str = "train.py:train") -> dict[str, Any]:
    from cog._inspector import create_predictor

    module_file, cls = predictor_ref.split(":")
    sys.path.insert(0, str(ROOT))
    info = create_predictor(Path(module_file).stem, cls)
    schema = openapi(info, declares_streaming(ROOT / module_file, cls, "run"))
    train_file, fn = trainer_ref.split(":")
    training(schema, create_predictor(Path(train_file).stem, fn))
    return schema


def training(schema: dict[str, Any], info) -> None:
    """The trainer's part, as `cog build` writes it for a cog.yaml with `train:`: TrainingInput and
    TrainingOutput (what coglet validates /trainings against), its request and response, its routes."""
    inputs, enums = input_schema(info)
    components = schema["components"]["schemas"]
    refs = {"Input": "TrainingInput", "Output": "TrainingOutput"}
    for kind in ("Request", "Response"):
        copied = json.loads(json.dumps(components[f"Prediction{kind}"]).replace(
            '"#/components/schemas/Input"', f'"#/components/schemas/{refs["Input"]}"').replace(
            '"#/components/schemas/Output"', f'"#/components/schemas/{refs["Output"]}"'))  # fmt: skip
        components[f"Training{kind}"] = {**copied, "title": f"Training{kind}"}
    components |= {"TrainingInput": {**inputs, "title": "TrainingInput"}, "TrainingOutput": info.output.json_type()}
    components |= {f"Training{name}": enum for name, enum in enums.items()}
    body = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/TrainingRequest"}}}}
    ok = {
        "description": "Successful Response",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TrainingResponse"}}},
    }
    schema["paths"]["/trainings"] = {
        "post": {"summary": "Train", "operationId": "train_trainings_post", "requestBody": body,
                 "responses": {"200": ok}}
    }  # fmt: skip
    schema["paths"]["/trainings/{training_id}/cancel"] = {
        "post": {"summary": "Cancel Training", "operationId": "cancel_training_trainings__training_id__cancel_post",
                 "responses": {"200": {"description": "Successful Response"}}}
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predictor", default="predict.py:Runner")
    parser.add_argument("--check", action="store_true", help="fail when the committed schema differs")
    args = parser.parse_args()
    text = json.dumps(build(args.predictor), indent=2) + "\n"
    if args.check:
        if not SCHEMA_PATH.exists() or SCHEMA_PATH.read_text() != text:
            sys.exit(f"{SCHEMA_PATH.relative_to(ROOT)} is out of date: run python -m scripts.cog_schema")
        return
    SCHEMA_PATH.parent.mkdir(exist_ok=True)
    SCHEMA_PATH.write_text(text)
    print(f"wrote {SCHEMA_PATH.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

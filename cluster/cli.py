"""`kvray serve [MODEL] --tensor-parallel-size 2 --max-replicas 4 ...`: the Serve app of
serve_app.py, with the same keys spelled as flags (vLLM's spelling), run in the foreground."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from typing import Any

from pydantic.fields import FieldInfo

from cluster.app_config import ENGINE_KEYS, AppConfig, load_app_config
from engine.arg_aliases import ALIASES


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _help(info: FieldInfo) -> str:
    default = info.get_default(call_default_factory=True)
    shown = json.dumps(default) if isinstance(default, dict) else default
    text = (info.description or "").replace("%", "%%")
    return f"{text} (default: {shown})".strip()


def _is_bool(annotation: Any) -> bool:
    return annotation is bool or (
        typing.get_origin(annotation) is not None
        and set(typing.get_args(annotation)) == {bool, type(None)}
    )


def _takes_none(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1 to 65535)")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvray", description="kvray: LLM serving on Ray Serve", allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (default: the bundled SmolLM2) with Ray Serve; several "
        "models with --models instead. Dict- and list-valued keys (--api-keys, --tenants, "
        "--default-chat-template-kwargs, --models) take JSON; keys that may be unset take "
        "none (--request-timeout-s none: no time limit).",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    serve.add_argument(
        "model_path", nargs="?", metavar="MODEL", help="same as --model (give one of the two)"
    )
    groups = {
        True: serve.add_argument_group("engine (vLLM's engine arguments)"),
        False: serve.add_argument_group("serving (replicas, queues, tenants, safety)"),
    }
    fields = sorted(AppConfig.model_fields.items(), key=lambda item: item[0] not in ENGINE_KEYS)
    for name, info in fields:
        group = groups[name in ENGINE_KEYS]
        if _is_bool(info.annotation):
            group.add_argument(
                _flag(name), dest=name, action=argparse.BooleanOptionalAction, help=_help(info)
            )
        elif name == "served_model_name":  # vLLM's spelling: --served-model-name a b
            group.add_argument(_flag(name), dest=name, nargs="+", metavar="NAME", help=_help(info))
        else:
            group.add_argument(_flag(name), dest=name, metavar="VALUE", help=_help(info))
    aliases = serve.add_argument_group("other names (the guides' spellings of the keys above)")
    for alias, entry in ALIASES.items():
        meaning = f"same as {_flag(entry.key)}" if entry.key else "refused"
        if entry.scale is not None:
            meaning = f"this x {entry.scale:g} is {_flag(entry.key)}"
        if entry.kvray_behaviour is not None:
            meaning = f"{str(entry.kvray_behaviour).lower()} accepted (no change), else refused"
        # A refused one may come as a bare switch (--skip-special-tokens): it is accepted or
        # refused saying why, not for a missing value.
        bare = {"nargs": "?", "const": "true"} if entry.key is None else {}
        aliases.add_argument(
            _flag(alias), dest=alias, metavar="VALUE", help=f"{meaning}: {entry.note}", **bare
        )
    run = serve.add_argument_group("this command")
    run.add_argument("--host", default="127.0.0.1", help="HTTP host (default: 127.0.0.1)")
    run.add_argument("--port", type=_port, default=8000, help="HTTP port (default: 8000)")
    run.add_argument("--name", default="kvray", help="Serve application name (default: kvray)")
    run.add_argument(
        "--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, or start one)"
    )
    parser.set_defaults(serve_parser=serve)
    return parser


def parse_serve_args(argv: list[str]) -> tuple[AppConfig, argparse.Namespace]:
    """Parse `serve ...` flags into a validated AppConfig (exits with the error naming a key)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    keys = {k: v for k, v in vars(args).items() if k in AppConfig.model_fields or k in ALIASES}
    for name, value in keys.items():
        key = ALIASES[name].key if name in ALIASES else name
        if key is None:  # a refused alias: load_app_config says why
            continue
        if _takes_none(AppConfig.model_fields[key].annotation) and _is_none(value):
            keys[name] = None
    names = keys.get("served_model_name")
    if names is not None and len(names) == 1:
        keys["served_model_name"] = names[0]
    if getattr(args, "model_path", None) is not None:
        if "model" in keys:
            args.serve_parser.error("give the model once: as MODEL or as --model, not both")
        keys["model"] = args.model_path
    try:
        return load_app_config(keys), args
    except ValueError as e:
        args.serve_parser.error(str(e))
        raise  # error() exits; this keeps type checkers informed


def _is_none(value: Any) -> bool:
    return isinstance(value, str) and value.lower() in ("none", "null")


def main(argv: list[str] | None = None) -> int:
    config, args = parse_serve_args(sys.argv[1:] if argv is None else argv)

    from cluster.topology import use_serve_fast_path

    use_serve_fast_path()  # before Ray's modules read it, and before a local Ray starts
    import ray
    from ray import serve

    from cluster.deployments import build_openai_app
    from cluster.grpc_api.serve_setup import grpc_options
    from cluster.metrics import metrics_notice

    ray.init(address=args.address)
    grpc = grpc_options(config.grpc_port) if config.grpc_port else None
    serve.start(http_options={"host": args.host, "port": args.port}, grpc_options=grpc)
    url = f"http://{args.host}:{args.port}"
    print(f"kvray: OpenAI's API at {url}/v1; {metrics_notice(url)}", flush=True)
    if grpc is not None:
        print(f"kvray: gRPC (kvray.v1.InferenceService) on port {config.grpc_port}", flush=True)
    try:
        serve.run(build_openai_app(config), name=args.name, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

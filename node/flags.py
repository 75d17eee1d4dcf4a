"""The command line, generated from the settings models: one flag per field, grouped by the
section it belongs to, with the field's description and default as its help. Nothing about a
setting is written here; add a field to its model and it becomes a flag, an `AGORA_*` variable
and a config-file key at once."""

from __future__ import annotations

import argparse
import typing
from typing import Any, Iterable, Literal

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return ""
    else:
        value = field.default
    if value is None or value is False or value == [] or value == "" or isinstance(value, SecretStr):
        return ""  # a secret's default is not shown, whatever it is
    if isinstance(value, list):
        value = " ".join(map(str, value))
    return f" (default: {value})"


def add_field_flag(group, name: str, field: FieldInfo, *, metavar: str | None = None,
                   help_text: str | None = None) -> None:
    """One argparse option for one model field; the default stays None so that only what the
    user typed overrides the environment and the config file. A field's json_schema_extra may
    rename its flag ("flag", "aliases"), name its value ("metavar"), describe a computed default
    ("default_text"), take a comma-separated word for a list ("comma_list") or take text that the
    model's validator parses ("text", e.g. sizes like 24GiB)."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    annotation = _unwrap_optional(field.annotation)
    flags = ["--" + str(extra.get("flag", name)).replace("_", "-"), *extra.get("aliases", [])]
    metavar = metavar or extra.get("metavar")
    if help_text is None:
        default = f" (default: {extra['default_text']})" if "default_text" in extra else _default_text(field)
        help_text = (field.description or "") + default
    help_text = help_text.replace("%", "%%")
    kwargs: dict[str, Any] = {"dest": name, "default": None, "help": help_text}
    if annotation is bool:
        group.add_argument(*flags, action="store_true", **kwargs)
        return
    if typing.get_origin(annotation) is list:
        if extra.get("comma_list"):
            group.add_argument(*flags, metavar=metavar or "A,B,...", **kwargs)
            return
        kwargs["nargs"] = "+"
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is Literal:
        kwargs["choices"] = list(typing.get_args(annotation))
    elif annotation in (int, float) and not extra.get("text"):
        kwargs["type"] = annotation
        kwargs["metavar"] = metavar or ("N" if annotation is int else "SECONDS" if name.endswith("_s") else "X")
    else:
        kwargs["metavar"] = metavar or name.split("_")[-1].upper()
    group.add_argument(*flags, **kwargs)


def add_model_flags(group, model: type[BaseModel], names: Iterable[str], metavars: dict[str, str] | None = None):
    """One flag per field of `names`, in that order except that the logging and metrics-port
    settings every process shares (roles/settings_base.py) come last, the same in every help."""
    from roles.settings_base import LoggingSettings, MetricsPortSettings

    tail = [*LoggingSettings.model_fields, *MetricsPortSettings.model_fields]
    names = sorted(names, key=lambda n: n in tail and tail.index(n) + 1)
    for name in names:
        add_field_flag(group, name, model.model_fields[name], metavar=(metavars or {}).get(name))


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the usage and exits 2 on a bad flag; we raise instead, so the CLI prints
    one line naming the fix, like every other mistake."""

    def error(self, message: str):
        from protocol.errors import ConfigError

        raise ConfigError(f"{message} (see {self.prog} --help)")


def model_from_args(model: type[BaseModel], args: argparse.Namespace) -> BaseModel:
    """`model` from parsed flags (unset and false ones left to their defaults); a validation error
    becomes a one-sentence ConfigError naming the flag."""
    from pydantic import ValidationError

    from protocol.errors import ConfigError

    values = {k: v for k, v in vars(args).items() if v is not None and v is not False}
    try:
        return model(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error.get("loc", ("settings",))[0])
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        if error.get("type") == "missing":
            raise ConfigError(f"--{name.replace('_', '-')} is required") from None
        raise ConfigError(f"--{name.replace('_', '-')}: {message}") from None

"""Flags made from config fields (``kvserve.flags``): every ``kvserve serve`` and ``kvserve
router`` option is a field of ServerConfig / RouterConfig, parsed back into one; defaults,
repeats, the environment fallback and parsed values behave as the help says."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvserve.cli import build_parser
from kvserve.flags import add_flags, flag, from_flags
from kvserve.router.config import RouterConfig
from kvserve.server.config import ServerConfig


@dataclasses.dataclass(frozen=True)
class Example:
    url: str = flag(help="required")
    port: int = flag(8000, "listen port")
    keys: tuple[str, ...] = flag((), "repeatable", name="--key", repeat=True)
    secret: str | None = flag(None, "or env", env="EXAMPLE_SECRET")
    size: int | None = flag(None, "parsed", parse=lambda text: len(text))
    ratio: float | None = flag(None, "typed", kind=float)
    internal: int = 3  # not a flag


def _parse(argv: list[str]) -> Example:
    parser = argparse.ArgumentParser()
    add_flags(parser, Example)
    return from_flags(Example, parser.parse_args(argv))


def test_flags_round_trip(monkeypatch):
    monkeypatch.delenv("EXAMPLE_SECRET", raising=False)
    got = _parse(["--url", "u", "--key", "a", "--key", "b", "--size", "four", "--ratio", "0.5"])
    assert got == Example("u", 8000, ("a", "b"), None, 4, 0.5)
    assert _parse(["--url", "u", "--port", "9"]).port == 9
    monkeypatch.setenv("EXAMPLE_SECRET", "from-env")
    assert _parse(["--url", "u"]).secret == "from-env"
    assert _parse(["--url", "u", "--secret", "given"]).secret == "given"
    assert _parse(["--url", "u", "--secret", ""]).secret == "from-env"  # empty: as absent
    monkeypatch.delenv("EXAMPLE_SECRET")
    assert _parse(["--url", "u", "--secret", ""]).secret is None
    assert _parse(["--url", "u", "--size", ""]).size is None  # nothing to parse


def test_required_and_typed_flags_are_refused_wrong():
    with pytest.raises(SystemExit):
        _parse([])  # --url is required
    with pytest.raises(SystemExit):
        _parse(["--url", "u", "--port", "eight"])


def _sub(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize(("command", "cls"), [("serve", ServerConfig), ("router", RouterConfig)])
def test_every_field_is_a_flag_with_the_dataclass_default(command, cls):
    dests = {a.dest: a for a in _sub(command)._actions}
    for f in dataclasses.fields(cls):
        assert f.name in dests, f"{command} has no flag for {cls.__name__}.{f.name}"
        if f.default not in (dataclasses.MISSING, None, ()):
            assert dests[f.name].default == f.default, f.name


def test_serve_flags_build_the_server_config(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CLUSTER_SECRET", "s3cret")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - name: acme\n")
    ns = build_parser().parse_args(
        ["serve", "--api-key", "k1", "--api-key", "k2", "--tenants", str(tenants),
         "--role", "both", "--queue-timeout", "2.5"]
    )  # fmt: skip
    config = from_flags(ServerConfig, ns)
    assert config.api_keys == ("k1", "k2") and config.queue_timeout == 2.5
    assert config.cluster_secret == "s3cret" and config.port == ServerConfig.port
    assert config.tenants is not None and [t.name for t in config.tenants.tenants] == ["acme"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--role", "primary"])

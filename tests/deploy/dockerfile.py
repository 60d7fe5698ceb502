"""A Dockerfile read into its stages and instructions, for checks of what the image is.

Only the syntax docker/Dockerfile uses: comments, ``\\`` continuations, ``FROM IMAGE AS
NAME``, exec-form (JSON) arguments, ``ENV K=V ...`` and options of the form ``--name=value``.
"""

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1] if found else None

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for args in self.all("ENV"):
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                values[key] = value
        return values


@dataclass
class Dockerfile:
    stages: list[Stage]

    @classmethod
    def read(cls, path: Path) -> "Dockerfile":
        lines: list[str] = []
        pending = ""
        for raw in path.read_text().splitlines():
            stripped = raw.strip()
            if not stripped or stripped.startswith("#"):
                continue
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            lines.append(pending + stripped)
            pending = ""
        assert not pending, f"{path} ends inside a continued line"
        stages: list[Stage] = []
        for line in lines:
            keyword, _, args = line.partition(" ")
            keyword, args = keyword.upper(), args.strip()
            if keyword == "FROM":
                words = args.split()
                name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
                stages.append(Stage(name, words[0]))
            elif stages:
                stages[-1].instructions.append((keyword, args))
        return cls(stages)

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def lineage(self, name: str) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first."""
        names = {s.name for s in self.stages}
        chain = [self.stage(name)]
        while chain[-1].base in names:
            chain.append(self.stage(chain[-1].base))
        return chain

    def effective(self, name: str, keyword: str) -> str | None:
        """The value of a keyword a stage's image carries (its own, else inherited)."""
        for stage in self.lineage(name):
            value = stage.last(keyword)
            if value is not None:
                return value
        return None

    def effective_env(self, name: str) -> dict[str, str]:
        values: dict[str, str] = {}
        for stage in reversed(self.lineage(name)):
            values.update(stage.env())
        return values


def exec_form(args: str) -> list[str]:
    """An instruction's JSON (exec form) arguments; fails on the shell form."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def split_options(args: str) -> tuple[dict[str, str], str]:
    """``--name=value`` options before an instruction's arguments, and the rest."""
    options: dict[str, str] = {}
    rest = args
    while rest.startswith("--"):
        option, _, rest = rest.partition(" ")
        key, _, value = option[2:].partition("=")
        options[key] = value
        rest = rest.strip()
    return options, rest

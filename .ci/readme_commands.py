"""Prints the README's set-up command N (1: install + the main job, 2: the tests): the lines of the
first ```bash block under "## Set-up" that are not comments. `.ci/run` runs them as written, so a
README whose commands fail turns CI red."""

import pathlib
import sys


def setup_commands(readme: str) -> list[str]:
    start = readme.index("```bash", readme.index("## Set-up")) + len("```bash")
    block = readme[start : readme.index("```", start)]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


if __name__ == "__main__":
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    print(setup_commands(readme)[int(sys.argv[1]) - 1])

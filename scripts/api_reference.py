"""Build shmq's API reference and check it: HTML pages made by pdoc from the package's
docstrings, signatures and type stubs (``python/shmq/_core.pyi`` for the Rust-backed
parts), one page per public module, into ``target/api-reference/`` (or the directory
given). Then every link between the pages is followed (a missing page or anchor fails),
and every name in ``shmq.__all__`` must have its entry on the package's page.

    python scripts/api_reference.py [OUT_DIR]

Run by ``scripts/test.sh``; needs pdoc (``pip install pdoc``, or the ``[test]`` extra) and
shmq built. Without pdoc it says so and exits with status 2.
"""

from __future__ import annotations

import html.parser
import importlib
import sys
from pathlib import Path
from urllib.parse import urldefrag, urlparse

ROOT = Path(__file__).resolve().parents[1]

#: The public modules, each a page. ``shmq.vllm_ec_connector`` and ``shmq.vllm_serde``
#: import vLLM: left out (with a note) where vLLM is not installed.
MODULES = [
    "shmq",
    "shmq.encoder_cache",
    "shmq.workers",
    "shmq.serde",
    "shmq.group",
    "shmq.relay",
    "shmq.admin",
    "shmq.metrics",
    "shmq.vllm_plugin",
    "shmq.vllm_ec_connector",
    "shmq.vllm_serde",
]


class _Page(html.parser.HTMLParser):
    """The ids and the link targets of one page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            elif name == "href" and value:
                self.links.append(value)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def check(out: Path) -> list[str]:
    """The broken links of the pages in ``out``, and the public names without an entry."""
    pages = {p: _parse(p) for p in out.rglob("*.html")}
    problems = []
    for path, page in pages.items():
        for link in page.links:
            if urlparse(link).scheme or link.startswith("//"):
                continue  # outside the reference
            target, fragment = urldefrag(link)
            file = (path.parent / target).resolve() if target else path
            if file not in pages:
                if not file.exists():
                    problems.append(f"{path.relative_to(out)}: link to a missing page {link!r}")
                continue
            if fragment and fragment not in pages[file].ids:
                problems.append(f"{path.relative_to(out)}: link to a missing entry {link!r}")
    import shmq

    package = pages.get((out / "shmq.html").resolve())
    for name in shmq.__all__:
        if package is None or (name not in package.ids and not name.startswith("__")):
            problems.append(f"shmq.html: no entry for the public name {name!r}")
    return problems


def main(argv: list[str]) -> int:
    import warnings

    try:
        import pdoc
    except ImportError as e:
        print(
            f"api reference: pdoc is not installed ({e}); install it with `pip install pdoc` "
            "(or the test extra: `pip install -e '.[test]'`), then run this script again",
            file=sys.stderr,
        )
        return 2

    # Annotations that name vLLM's classes under TYPE_CHECKING are shown as written.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"pdoc\.")

    out = Path(argv[1] if len(argv) > 1 else ROOT / "target" / "api-reference").resolve()
    modules = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"api reference: {name} left out ({e})", file=sys.stderr)
            continue
        modules.append(name)
    pdoc.render.configure(docformat="restructuredtext", show_source=False, search=True)
    pdoc.pdoc(*modules, output_directory=out)
    problems = check(out)
    for p in problems:
        print(f"api reference: {p}", file=sys.stderr)
    pages = sum(1 for _ in out.rglob("*.html"))
    print(f"api reference: {pages} pages in {out}, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

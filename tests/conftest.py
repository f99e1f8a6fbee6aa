"""The suite's two tiers, and the engine tier's shared engines.

``python -m pytest`` runs the fast tier: the planner, its oracle and properties, the NIXL
executor between real agents, the docs, the two-host namespace tests. ``python -m pytest -m
engines`` runs the engine tier: every test that needs the vLLM venv (tests/vllm_env.py), most
of them driving real vLLM engines (tests/vllm_pool.py). pyproject.toml's ``addopts`` holds
``-m "not engines"``; a later ``-m`` on the command line replaces it.

Which tier a test is in is not written by hand: a test that asks for the ``vllm_python``
fixture (directly, or through ``pool``) or the ``sglang_python`` fixture (SGLang's own
transfer code, run on CPU in its venv: tests/sglang_env.py) is marked ``engines`` at
collection, so a new engine test cannot land in the fast tier by mistake.

The engine tier starts each engine once for the whole session where memory allows
(:class:`tests.vllm_pool.Pool` parks what a test does not name), and runs its tests grouped
by the model they start: a test marked ``engines("nemo1")`` runs beside every other test of
``nemo1``, whatever its file, in the order the groups first appear (the order of
:data:`GROUPS`, then collection order). A test's own file order is kept within its group.
"""

from __future__ import annotations

import pytest

ENGINES = "engines"

#: The engine tier's groups in the order they run: engines of one model, so that its engines
#: start once (a group absent here runs after these, in collection order). First the tests
#: that need the vLLM venv but start no engine (``engines`` without a model: seconds each),
#: then the dense Llama: a broken connector fails there within minutes.
GROUPS = ("", "llama", "upgrade", "nemo1", "nemo2", "gemma3", "mla", "eagle", "mlaeagle", "http")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{ENGINES}(model=None): needs the vLLM or SGLang venv (the engine tier, "
                   f"run with `-m {ENGINES}`); ``model`` groups the tests that start that model's "
                   "engines (tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that needs the vLLM or the SGLang venv, before ``-m`` selects (hence
    tryfirst); a test that starts engines (the ``pool`` fixture) must name its model group."""
    unnamed = []
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if (("vllm_python" in fixtures or "sglang_python" in fixtures)
                and item.get_closest_marker(ENGINES) is None):
            item.add_marker(ENGINES)
        if "pool" in fixtures and not _group(item):
            unnamed.append(item.nodeid)
    if unnamed:
        raise pytest.UsageError(
            "engine tests that name no model group (mark each "
            "@pytest.mark.engines(\"MODEL\"), MODEL the tiny model whose engines it starts): "
            + ", ".join(unnamed))


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker(ENGINES)
    if mark is None:
        return None
    return mark.args[0] if mark.args else mark.kwargs.get("model", "")


def _group_engine_tests(items: list[pytest.Item]) -> None:
    """Engine tests grouped by model (:data:`GROUPS` first), stable within a group; the fast
    tier's order is left as collected."""
    groups = [_group(i) for i in items]
    if not any(groups):
        return
    rank = {g: k for k, g in enumerate(GROUPS)}
    seen: dict[str, int] = {}
    for g in groups:
        if g is not None:
            seen.setdefault(g, len(GROUPS) + len(seen))
    keyed = sorted(range(len(items)), key=lambda k: (
        groups[k] is not None, rank.get(groups[k], seen.get(groups[k], 0)), k))
    items[:] = [items[k] for k in keyed]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """After deselection and pytest's own fixture-parameter ordering: group the engine tier."""
    _group_engine_tests(session.items)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """Say how to run the tier ``-m`` left out, and how many engines the tier started."""
    deselected = len(terminalreporter.stats.get("deselected", []))
    markexpr = config.getoption("markexpr", "")
    if deselected and markexpr == f"not {ENGINES}":
        terminalreporter.write_line(
            f"{deselected} engine-tier tests deselected: run them with "
            f"`python -m pytest -m {ENGINES}` (real vLLM engines, SGLang's own transfer code; "
            "README.md)")
    from tests import vllm_pool

    if vllm_pool.STARTS:
        terminalreporter.write_line(
            f"engines started: {sum(vllm_pool.STARTS.values())} "
            f"({len(vllm_pool.STARTS)} distinct)")
    if vllm_pool.UNLISTED:
        terminalreporter.write_line(
            "engines started that tests/vllm_pool.py SETS does not list (each started when "
            f"named, not beside its model's others): {', '.join(sorted(vllm_pool.UNLISTED))}")


@pytest.fixture(scope="session")
def vllm_python():
    """The vLLM venv's interpreter (built on first use, cached across runs); the test skips,
    saying why, where it cannot be installed."""
    from tests import vllm_env

    try:
        return vllm_env.ensure()
    except vllm_env.EnvUnavailable as e:
        pytest.skip(f"vLLM's CPU build cannot be installed here: {e}")


@pytest.fixture(scope="session")
def vllm_previous(vllm_python):
    """The previous vLLM's venv interpreter (tests/vllm_env.py ``PREVIOUS``: the other side of
    a rolling upgrade), built on first use like the default one; skips, saying why, where it
    cannot be installed."""
    from tests import vllm_env

    try:
        return vllm_env.ensure(version=vllm_env.PREVIOUS)
    except vllm_env.EnvUnavailable as e:
        pytest.skip(f"vLLM {vllm_env.PREVIOUS}'s CPU build cannot be installed here: {e}")


@pytest.fixture(scope="session")
def sglang_python():
    """The SGLang venv's interpreter (built on first use, cached across runs); the test skips,
    saying why, where it cannot be installed."""
    from tests import sglang_env

    try:
        return sglang_env.ensure()
    except sglang_env.EnvUnavailable as e:
        pytest.skip(f"SGLang {sglang_env.SGLANG_VERSION} cannot be installed here: {e}")


@pytest.fixture(scope="session")
def pool(vllm_python, tmp_path_factory):
    """The session's engines (:class:`tests.vllm_pool.Pool`): one tiny model of each kind and
    one inductor cache for all, every engine stopped and orphaned shared memory removed at
    the end."""
    from tests.vllm_pool import engine_pool

    with engine_pool(vllm_python, tmp_path_factory.mktemp("engines")) as p:
        yield p

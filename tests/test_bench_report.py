"""``make bench``'s figure: a measurement that did not run says so in its panel (``--stack-minutes 0`` skips the
``make run`` steady state (g)); one that ran draws its bars. ``make bench-live --views``' copies of view versions
are declared and importable as versions of their own; a ``make bench-live`` leg imports only what its default
baseline's tree has."""

from __future__ import annotations

from pathlib import Path

from kappa.front.bench import _figure


def _result(**more):
    return {"events": 1000, "raw_ceiling": {"events_per_s": 50_000.0}, "replay": {"events_per_s": 20_000.0},
            "live": {"achieved_rate": 200.0, "p50_s": 3.0, "p99_s": 7.0}, "peak_rss_mb": {"view host": 2800.0},
            **more}


def _panel(fig, title: str):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def test_a_panel_whose_measurement_did_not_run_says_so():
    fig = _figure(_result(stack=None))
    g = _panel(fig, "make run steady state (g)")
    assert [t.get_text() for t in g.texts] == ["not run (--stack-minutes 0)"]
    assert not g.patches  # no bars, no ticks: nothing that reads as a measurement of zero
    assert [t.get_text() for t in _panel(fig, "replay per core (h)").texts] == ["not run"]


def test_a_panel_whose_measurement_ran_draws_it():
    fig = _figure(_result(stack={"views": {"events_raw@v1": {"lag_seconds_max": 4.0},
                                           "user_sessions@v1": {"lag_seconds_max": 6.2}}},
                          per_core={"runs": {"1": {"events_per_s": 9000.0, "events_per_s_per_core": 9000.0}}}))
    g = _panel(fig, "make run steady state (g)")
    assert not g.texts and [round(p.get_height(), 1) for p in g.patches] == [4.0, 6.2]
    assert not _panel(fig, "replay per core (h)").texts


def test_many_views_declares_versions_that_run_side_by_side(tmp_path):
    """``make bench-live --views 20``: the declared views' other versions, then copies of the views over ad-events
    (the archive aside) - each importable under the platform file the bench writes, with its own version number and
    metrics port, and publishing nothing; the copies' source views are unchanged."""
    import json
    import os
    import subprocess
    import sys

    from kappa.catalog import load_catalog
    from kappa.front.bench_live import COPY_VERSION_BASE, many_versions

    declared = load_catalog()
    extras, env = many_versions(20, tmp_path)
    defaults = [(name, spec.default_version) for name, spec in declared.views.items()]
    assert len(defaults) + len(extras) == 20 and len(set(extras)) == len(extras)
    others = [(n, v) for n, s in declared.views.items() for v in s.versions if v != s.default_version]
    assert extras[: len(others)] == others
    copies = extras[len(others):]
    assert copies and all(v >= COPY_VERSION_BASE for _, v in copies)
    over_events = {n for n, s in declared.views.items() if "ad-events" in s.topics and not s.archives}
    assert {n for n, _ in copies} == over_events
    assert many_versions(len(defaults), tmp_path / "none") == ([], {})
    probe = (
        "import json\n"
        "from kappa.catalog import load_catalog\n"
        "from kappa.control.runners.local import metrics_port\n"
        "from kappa.runtime.view import load_view\n"
        "out = []\n"
        "for name, spec in load_catalog().views.items():\n"
        "    for version, module in spec.versions.items():\n"
        "        view = load_view(module)\n"
        "        out.append([name, version, view.name, view.version, view.publish is not None,\n"
        "                    metrics_port(name, version)])\n"
        "print(json.dumps(out))\n")
    path = os.pathsep.join([env["PYTHONPATH"], str(Path(__file__).parents[1])])
    rows = json.loads(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                                     env={**os.environ, **env, "PYTHONPATH": path}).stdout)
    versions = sum(len(s.versions) for s in declared.views.values()) + len(copies)
    assert len(rows) == len({(n, v) for n, v, *_ in rows}) == versions
    assert all(name == vname and version == vversion for name, version, vname, vversion, *_ in rows)
    assert len({port for *_, port in rows}) == len(rows)  # every version its own metrics port
    publishing = {(n, v) for n, v, _, _, publishes, _ in rows if publishes}
    assert publishing and not publishing & set(copies)


def _defines(source: str, name: str) -> bool:
    """Whether a module's source binds ``name`` at its top level (def, class, assignment or import)."""
    import ast

    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return True
    return False


def test_a_bench_live_leg_imports_only_what_the_default_baseline_has():
    """``make bench-live`` runs its leg - this file's ``leg`` - in the baseline's tree (fc054fe by default): every
    ``kappa`` name the leg imports outside a ``try ... except ImportError`` must exist there (a leg once imported
    a function added later, and every ``make bench-live`` failed in its baseline leg)."""
    import ast
    import subprocess

    from kappa.front import bench_live

    root = Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "kappa/front/bench_live.py").read_text())
    leg = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "leg")
    guarded = {id(n) for t in ast.walk(leg) if isinstance(t, ast.Try)
               if any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in t.handlers)
               for stmt in t.body for n in ast.walk(stmt)}
    wanted = [(node.module, alias.name) for node in ast.walk(leg)
              if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kappa")
              and id(node) not in guarded for alias in node.names]
    assert wanted  # the walk found the leg's imports
    missing = []
    for module, name in wanted:
        path = module.replace(".", "/")
        shown = subprocess.run(["git", "show", f"{bench_live.BASELINE}:{path}.py"], cwd=root, capture_output=True,
                               text=True)
        if shown.returncode != 0:
            shown = subprocess.run(["git", "show", f"{bench_live.BASELINE}:{path}/__init__.py"], cwd=root,
                                   capture_output=True, text=True)
        submodule = subprocess.run(["git", "cat-file", "-e", f"{bench_live.BASELINE}:{path}/{name}.py"], cwd=root)
        if submodule.returncode != 0 and (shown.returncode != 0 or not _defines(shown.stdout, name)):
            missing.append(f"{module}.{name}")
    assert not missing, f"not in {bench_live.BASELINE}: {missing}"


def test_the_shared_floor_reads_each_topic_once_for_every_view_over_it():
    """``make bench-live --shared-floor``: the engine floor with one read per topic groups the declared views by the
    topic, format and trigger they read with, one query each; the plain floor runs one query per view version."""
    from kappa.config import Settings
    from kappa.front import stack
    from kappa.front.bench_live import floor_queries
    from kappa.runtime.job import live_trigger_seconds
    from kappa.runtime.view import load_view
    from kappa.control.replay.version import module_of

    refs = stack.stack_views(Settings.from_env())
    alone = floor_queries(refs, shared=False)
    assert [names for _key, names in alone] == [[f"{n}@v{v}"] for n, v in refs]
    shared = floor_queries(refs, shared=True)
    assert sorted(n for _key, names in shared for n in names) == sorted(f"{n}@v{v}" for n, v in refs)
    for (topic, fmt, trigger), names in shared:  # each member reads what its query reads, as it declares
        for ref in names:
            name, version = ref.split("@v")
            view = load_view(module_of(name, int(version)))
            assert (view.stream_topic, view.stream_format, live_trigger_seconds(view)) == (topic, fmt, trigger)
    assert len({key for key, _names in shared}) == len(shared)  # one query per (topic, format, trigger)
    fresh = [names for (topic, _fmt, trigger), names in shared if topic == "ad-events" and trigger <= 2]
    assert len(fresh) == 1 and len(fresh[0]) >= 3, shared  # the fresh views over ad-events share one read

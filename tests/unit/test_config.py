from pathlib import Path

import pytest

from retrain.config import load_params, parse_params
from retrain.errors import ConfigError
from retrain.workspace import TEMPLATE_FILES, template_text
from tests.helpers import REPO


def test_template_params_are_valid_and_match_defaults():
    import yaml

    params = parse_params(yaml.safe_load(template_text("params.yaml")))
    assert params.merge.val_fraction == 0.2
    assert params == parse_params({})


def test_repo_root_is_a_workspace_with_the_template_pipeline_files():
    for src, dst in TEMPLATE_FILES.items():
        if src in ("dvc.yaml", "params.yaml", "dvcignore", "data.gitignore"):
            assert (REPO / dst).read_text() == template_text(src), f"{dst} differs from templates/{src}"
    assert (REPO / ".dvc" / "config").is_file()


def test_unknown_key_is_refused_naming_it(tmp_path: Path):
    p = tmp_path / "params.yaml"
    p.write_text("merge:\n  val_fraction: 0.2\n  val_fracton: 0.3\n")
    with pytest.raises(ConfigError, match=r"params.yaml: merge.val_fracton: Extra inputs are not permitted"):
        load_params(p)


def test_unknown_section_is_refused(tmp_path: Path):
    p = tmp_path / "params.yaml"
    p.write_text("mergee: {}\n")
    with pytest.raises(ConfigError, match=r"mergee"):
        load_params(p)


@pytest.mark.parametrize("text,key", [
    ("merge:\n  val_fraction: 1.5\n", "merge.val_fraction"),
    ("merge:\n  val_fraction: lots\n", "merge.val_fraction"),
    ("ingest:\n  box_tolerance_px: -1\n", "ingest.box_tolerance_px"),
])
def test_bad_value_names_the_key(tmp_path: Path, text: str, key: str):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=key):
        load_params(p)


def test_python_tag_is_refused(tmp_path: Path):
    p = tmp_path / "params.yaml"
    p.write_text("merge: !!python/object/apply:os.system ['touch canary']\n")
    with pytest.raises(ConfigError, match="not safe YAML"):
        load_params(p)
    assert not (tmp_path / "canary").exists()


def test_missing_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="file not found"):
        load_params(tmp_path / "params.yaml")


def test_prefect_yaml_declares_the_weekly_and_on_new_batch_deployments_of_the_flow_with_the_params_schedule():
    import yaml
    from prefect.utilities.importtools import import_object

    doc = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert (REPO / "prefect.yaml").read_text() == template_text("prefect.yaml")  # `retrain init` copies it
    deployments = {d["name"]: d for d in doc["deployments"]}
    assert set(deployments) == {"weekly", "on-new-batch"}
    params = parse_params({}).retrain
    weekly, poll = deployments["weekly"], deployments["on-new-batch"]
    assert weekly["schedules"] == [{"cron": params.schedule, "timezone": params.timezone}]
    assert poll["schedules"] == [{"interval": params.poll_interval}] and poll["parameters"]["only_if_new"] is True
    for d in (weekly, poll):
        assert import_object(d["entrypoint"]).name == "retrain"  # the installed flow, loadable by a worker
        assert d["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}

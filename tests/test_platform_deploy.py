"""The deploy files, checked by the platforms' own client libraries, and the entry
points' exit statuses (docs/operations.md, "How the deploy files are checked").

* databricks-sdk: the job round-trips through its ``JobSettings`` type unchanged, and
  its keys are the parameters of ``JobsAPI.create``.
* botocore: every EMR and Scheduler request the files feed passes its parameter
  validation (the models the AWS SDKs are generated from).
* the AWS CLI (``awscli``): each ``aws emr`` / ``aws scheduler`` command of
  docs/operations.md, run as written against a stand-in endpoint on 127.0.0.1
  (tests/aws_standin.py) with fake credentials; what it sent is checked.
* the caption task / step carries the GPU settings its config needs.
* entry points launched as a Databricks ``python_wheel_task`` launches them exit 2, 3, 4
  and 1 for a config error, a held lock, a budget breach and a crashed stage.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import JARS_DIR, REPO

from etl.config import load_config
from etl.pipeline.stages import STAGES

DEPLOY = REPO / "deploy"
JOB = json.loads((DEPLOY / "databricks-job.json").read_text())
STEPS = json.loads((DEPLOY / "emr-steps.json").read_text())
SCHEDULE = json.loads((DEPLOY / "emr-schedule.json").read_text())
GROUPS = json.loads((DEPLOY / "emr-instance-groups.json").read_text())
CONFIGURATIONS = json.loads((DEPLOY / "emr-configurations.json").read_text())
GPU_KEYS = ("spark.executor.resource.gpu.amount", "spark.task.resource.gpu.amount",
            "spark.executor.resource.gpu.discoveryScript")
# Instance families with NVIDIA GPUs (AWS): what a GPU node type must be.
GPU_FAMILIES = ("g4dn", "g5", "g6", "g6e", "p3", "p4d", "p4de", "p5")


def _diff(a, b, path="") -> list[str]:
    """Every key dropped, added or changed between two JSON values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in b:
                out.append(f"dropped {path}.{k}")
            elif k not in a:
                out.append(f"added {path}.{k}")
            else:
                out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"changed {path}: {a!r} -> {b!r}"]


# ------------------------------------------------------------------ Databricks


def test_databricks_job_survives_the_sdk_types_unchanged():
    from databricks.sdk.service.jobs import JobsAPI, JobSettings

    assert _diff(JOB, JobSettings.from_dict(JOB).as_dict()) == []
    create = set(inspect.signature(JobsAPI.create).parameters) - {"self"}
    assert set(JOB) <= create, set(JOB) - create


def _stage_of(task: dict) -> str:
    params = task["python_wheel_task"]["parameters"]
    return params[params.index("--only") + 1]


def test_databricks_tasks_run_every_stage_in_order_under_one_run_id():
    tasks = {t["task_key"]: t for t in JOB["tasks"]}
    order, done = [], set()
    while len(order) < len(tasks):  # a topological walk of depends_on
        ready = [k for k, t in tasks.items() if k not in done
                 and {d["task_key"] for d in t.get("depends_on", [])} <= done]
        assert len(ready) == 1, f"not a chain at {order}: {ready}"
        order.append(ready[0])
        done.add(ready[0])
    assert [_stage_of(tasks[k]) for k in order] == list(STAGES.names())
    clusters = {c["job_cluster_key"] for c in JOB["job_clusters"]}
    for task in JOB["tasks"]:
        wheel, params = task["python_wheel_task"], task["python_wheel_task"]["parameters"]
        assert task["job_cluster_key"] in clusters
        assert wheel["package_name"] == "lakeshard" and wheel["entry_point"] == "lakeshard-run"
        assert params[params.index("--run-id") + 1] == "{{job.run_id}}"
        conf = params[params.index("--conf") + 1]
        assert Path(conf).name == "databricks.yaml"
        assert [lib["whl"] for lib in task["libraries"]] == [
            "/Volumes/main/lakeshard/artifacts/lakeshard-0.1.0-py3-none-any.whl"]
    load_config(REPO / "conf" / "databricks.yaml")


def _runtime(spark_version: str) -> tuple[str, str]:
    """(DBR version, flavour) of a spark_version key, e.g. ('17.3', 'gpu-ml')."""
    m = re.fullmatch(r"(\d+\.\d+)\.x-(cpu-ml|gpu-ml)-scala2\.13", spark_version)
    assert m, f"{spark_version}: not an ML runtime key for Scala 2.13"
    return m.group(1), m.group(2)


# Databricks runtimes and the Spark each ships (docs/operations.md, "Platforms").
DBR_SPARK = {"17.3": "4.0", "18.0": "4.1"}


def test_caption_task_runs_on_a_gpu_cluster_with_what_the_config_needs():
    from etl.session import SUPPORTED_SPARK

    cfg = load_config(REPO / "conf" / "databricks.yaml")
    assert any(v.device == "cuda" for v in cfg.caption.versions.values())
    # Resource settings only take effect at cluster start: none in the config.
    assert not set(GPU_KEYS) & set(cfg.spark.conf)
    clusters = {c["job_cluster_key"]: c["new_cluster"] for c in JOB["job_clusters"]}
    supported = {f"{a}.{b}" for a, b in SUPPORTED_SPARK}
    for task in JOB["tasks"]:
        cluster = clusters[task["job_cluster_key"]]
        version, flavour = _runtime(cluster["spark_version"])
        assert DBR_SPARK[version] in supported
        conf = cluster.get("spark_conf", {})
        nodes = {cluster["node_type_id"], cluster.get("driver_node_type_id",
                                                      cluster["node_type_id"])}
        gpu_nodes = {n.split(".")[0] in GPU_FAMILIES for n in nodes}
        if _stage_of(task) != "caption":
            assert flavour == "cpu-ml" and gpu_nodes == {False}
            assert not set(GPU_KEYS) & set(conf), task["task_key"]
            continue
        assert flavour == "gpu-ml" and gpu_nodes == {True}  # driver and workers
        executor, per_task = (float(conf[k]) for k in GPU_KEYS[:2])
        assert executor >= 1 and 0 < per_task <= executor
        assert conf[GPU_KEYS[2]] == "/databricks/spark/scripts/gpu/get_gpus_resources.sh"
        assert cluster.get("num_workers", 0) >= 1  # GPU scheduling is off on single node


# ------------------------------------------------------------------ EMR: botocore


def _client(service: str):
    import botocore.session

    return botocore.session.get_session().create_client(
        service, region_name="us-east-1", aws_access_key_id="standin",
        aws_secret_access_key="standin")


def _validate(service: str, operation: str, params: dict) -> None:
    from botocore.validate import ParamValidator

    shape = _client(service).meta.service_model.operation_model(operation).input_shape
    report = ParamValidator().validate(params, shape)
    assert not report.has_errors(), report.generate_report()


def _api_steps(steps: list[dict], run_id: str) -> list[dict]:
    """The CLI's step shape in the API's (HadoopJarStep), computed here."""
    return [{"Name": s["Name"], "ActionOnFailure": s["ActionOnFailure"],
             "HadoopJarStep": {"Jar": s["Jar"],
                               "Args": [a.replace("@RUN_ID@", run_id) for a in s["Args"]]}}
            for s in steps]


def test_schedule_and_its_steps_pass_botocore_validation():
    _validate("scheduler", "CreateSchedule", SCHEDULE)
    target = SCHEDULE["Target"]
    assert target["Arn"] == "arn:aws:scheduler:::aws-sdk:emr:addJobFlowSteps"
    payload = json.loads(target["Input"])
    _validate("emr", "AddJobFlowSteps", payload)  # what the universal target calls
    assert payload["Steps"] == _api_steps(STEPS, "<aws.scheduler.execution-id>")


def _args(step: dict) -> list[str]:
    return step["Args"]


def _confs(args: list[str]) -> dict[str, str]:
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--conf"
                and "=" in args[i + 1])


def test_emr_steps_run_each_stage_with_the_release_jars_and_gpus_for_caption():
    stages = []
    for step in STEPS:
        args = _args(step)
        assert step["Type"] == "CUSTOM_JAR" and step["Jar"] == "command-runner.jar"
        assert step["ActionOnFailure"] == "CANCEL_AND_WAIT"  # a failure stops the rest
        assert args[:5] == ["spark-submit", "--master", "yarn", "--deploy-mode", "client"]
        jars = args[args.index("--jars") + 1].split(",")
        assert [Path(j).name for j in jars] == ["delta-spark_2.13-4.0.0.jar",
                                                 "delta-storage-4.0.0.jar"]
        assert args[args.index("--py-files") + 1] == jars[0]  # its Python `delta`
        spark40 = JARS_DIR / "spark40"
        if spark40.is_dir():  # exactly what `make jars-spark40` fetches
            assert sorted(p.name for p in spark40.glob("*.jar")) == sorted(
                Path(j).name for j in jars)
        app = next(a for a in args if a.endswith(".py"))
        assert (REPO / "etl" / "entrypoints" / Path(app).name).is_file()
        rest = args[args.index(app) + 1:]
        assert Path(rest[rest.index("--conf") + 1]).name == "emr.yaml"
        assert rest[rest.index("--run-id") + 1] == "@RUN_ID@"
        stage = rest[rest.index("--only") + 1]
        stages.append(stage)
        confs = _confs(args)
        if stage == "caption":
            executor, per_task = (float(confs[k]) for k in GPU_KEYS[:2])
            assert executor >= 1 and 0 < per_task <= executor
            assert confs[GPU_KEYS[2]] == "/usr/lib/spark/scripts/gpu/getGpusResources.sh"
            # task slots per executor: the cores' limit equals the GPUs' limit
            assert int(confs["spark.executor.cores"]) // int(confs["spark.task.cpus"]) == \
                int(executor / per_task)
        else:
            assert not set(GPU_KEYS) & set(confs), stage
    assert stages == list(STAGES.names())
    cfg = load_config(REPO / "conf" / "emr.yaml")
    assert not set(GPU_KEYS) & set(cfg.spark.conf)  # or every step would ask for GPUs
    assert any(v.device == "cuda" for v in cfg.caption.versions.values())


def test_emr_gpu_group_schedules_gpus_in_yarn():
    by_type = {g["InstanceGroupType"]: g for g in GROUPS}
    assert set(by_type) == {"MASTER", "CORE", "TASK"}
    gpu = by_type["TASK"]
    assert gpu["InstanceType"].split(".")[0] in GPU_FAMILIES
    assert by_type["CORE"]["InstanceType"].split(".")[0] not in GPU_FAMILIES
    conf = {c["Classification"]: c for c in gpu["Configurations"]}
    site = conf["yarn-site"]["Properties"]
    assert site["yarn.nodemanager.resource-plugins"] == "yarn.io/gpu"
    assert site["yarn.nodemanager.container-executor.class"].endswith("LinuxContainerExecutor")
    inner = {c["Classification"]: c["Properties"] for c in conf["container-executor"]
             ["Configurations"]}
    assert inner["gpu"]["module.enabled"] == "true"
    assert inner["cgroups"]["root"] == site[
        "yarn.nodemanager.linux-container-executor.cgroups.mount-path"]
    cluster = {c["Classification"]: c["Properties"] for c in CONFIGURATIONS}
    assert cluster["yarn-site"]["yarn.resource-types"] == "yarn.io/gpu"
    assert cluster["capacity-scheduler"]["yarn.scheduler.capacity.resource-calculator"] \
        .endswith("DominantResourceCalculator")
    boot = (DEPLOY / "emr-bootstrap.sh").read_text()
    assert "/spark-rapids-cgroup/devices" in boot and "python3.12 -m venv" in boot


# ------------------------------------------------------------------ EMR: the AWS CLI


def _documented_commands() -> list[str]:
    """The `aws emr …` and `aws scheduler …` commands of docs/operations.md, as written
    (continuation lines joined)."""
    text = (REPO / "docs" / "operations.md").read_text()
    commands, current = [], None
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if current is not None:
                current += " " + line.strip().rstrip("\\").strip()
                if not line.rstrip().endswith("\\"):
                    commands.append(current)
                    current = None
            elif re.match(r"aws (emr|scheduler) ", line):
                if line.rstrip().endswith("\\"):
                    current = line.rstrip().rstrip("\\").strip()
                else:
                    commands.append(line.split("  #", 1)[0].strip())
    return commands


@pytest.fixture(scope="module")
def cli_requests(tmp_path_factory):
    """Every documented command, run by the AWS CLI against the stand-in endpoint."""
    from aws_standin import AwsStandIn

    aws = shutil.which("aws", path=str(Path(sys.executable).parent))
    assert aws, "the AWS CLI (awscli, the test extra) is not installed in this venv"
    home = tmp_path_factory.mktemp("aws-home")
    commands = _documented_commands()
    with AwsStandIn() as standin:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("AWS_") and k.lower() not in ("http_proxy", "https_proxy")}
        env.update({
            "HOME": str(home), "AWS_ACCESS_KEY_ID": "standin",
            "AWS_SECRET_ACCESS_KEY": "standin", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(home / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "credentials"),
            "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
            "PATH": f"{Path(aws).parent}{os.pathsep}{env.get('PATH', '')}",
            "ARTIFACTS": "s3://my-bucket/lakeshard/artifacts", "SUBNET_ID": "subnet-0abc1234",
            "CLUSTER_ID": "j-STANDIN00001", "RUN_ID": "manual-20261201T010000Z",
        })
        for command in commands:
            res = subprocess.run(["bash", "-c", f"{command} --endpoint-url {standin.url}"],
                                 cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=120)
            assert res.returncode == 0, (command, res.stdout, res.stderr[-3000:])
        yield commands, list(standin.requests)


def test_every_documented_aws_command_is_accepted_by_the_cli(cli_requests):
    commands, requests = cli_requests
    assert [c.split()[1:3] for c in commands] == [
        ["emr", "create-cluster"], ["scheduler", "create-schedule"], ["emr", "add-steps"]]
    # each command's requests, each answered (nothing unexpected was called)
    assert [r.operation for r in requests] == ["RunJobFlow", "CreateSchedule",
                                               "DescribeCluster", "AddJobFlowSteps"]


def test_cli_cluster_request_is_emr_spark_8_with_cpu_and_gpu_groups(cli_requests):
    _, requests = cli_requests
    (run,) = [r.body for r in requests if r.operation == "RunJobFlow"]
    _validate("emr", "RunJobFlow", run)
    assert run["ReleaseLabel"] == "emr-spark-8.0.0"
    assert [a["Name"] for a in run["Applications"]] == ["Spark"]
    groups = {g["InstanceRole"]: g for g in run["Instances"]["InstanceGroups"]}
    assert {r: g["InstanceType"] for r, g in groups.items()} == {
        g["InstanceGroupType"]: g["InstanceType"] for g in GROUPS}
    assert groups["TASK"]["Configurations"] == next(
        g["Configurations"] for g in GROUPS if g["InstanceGroupType"] == "TASK")
    assert run["Configurations"] == CONFIGURATIONS
    (boot,) = run["BootstrapActions"]
    assert boot["ScriptBootstrapAction"] == {
        "Path": "s3://my-bucket/lakeshard/artifacts/emr-bootstrap.sh",
        "Args": ["s3://my-bucket/lakeshard/artifacts"]}


def test_cli_schedule_and_steps_are_the_files_in_the_api_shape(cli_requests):
    _, requests = cli_requests
    (schedule,) = [r for r in requests if r.operation == "CreateSchedule"]
    assert schedule.path == f"/schedules/{SCHEDULE['Name']}"
    sent = {**schedule.body, "Name": SCHEDULE["Name"]}
    sent.pop("ClientToken", None)  # the CLI adds an idempotency token
    _validate("scheduler", "CreateSchedule", sent)
    assert sent == SCHEDULE
    (steps,) = [r.body for r in requests if r.operation == "AddJobFlowSteps"]
    _validate("emr", "AddJobFlowSteps", steps)
    assert steps == {"JobFlowId": "j-STANDIN00001",
                     "Steps": _api_steps(STEPS, "manual-20261201T010000Z")}
    # the schedule adds the same steps, with the scheduler's execution id as run id
    assert json.loads(SCHEDULE["Target"]["Input"])["Steps"] == _api_steps(
        STEPS, "<aws.scheduler.execution-id>")


# ------------------------------------------------------------------ exit statuses


def _wheel_task(*params: str, env: dict | None = None, timeout: int = 300):
    """The `lakeshard-run` entry point, launched as a python_wheel_task launches it."""
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / "wheel_task.py"), "lakeshard", "lakeshard-run",
         *params], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def _conf(tmp_path: Path, **extra) -> Path:
    conf = tmp_path / "conf.yaml"
    conf.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "data")},
        "spark": {"master": "local[1]", "jars_dir": str(JARS_DIR),
                  "conf": {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "1",
                           "spark.databricks.delta.snapshotPartitions": "1"}},
        "run": {"report": False, "progress_interval_s": 0},
        "sources": [{"name": "pics", "kind": "image_folder", "path": str(tmp_path / "p")}],
        **extra,
    }))
    return conf


def _pictures(folder: Path, n: int) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (96, 80), (40 * i, 90, 200 - 30 * i)).save(folder / f"{i}.png")


def test_config_error_and_held_lock_exit_2_and_3_before_spark(tmp_path):
    conf = _conf(tmp_path, run={"stages": ["curate", "captions"]})
    res = _wheel_task("--conf", str(conf))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "run.stages[1]: unknown stage 'captions'" in res.stderr
    res = _wheel_task("--conf", str(_conf(tmp_path)), "--run-id", "not a run id")
    assert res.returncode == 2 and "--run-id: 'not a run id'" in res.stderr

    from etl.runtime.lock import RunLock

    _pictures(tmp_path / "p", 1)
    with RunLock(str(tmp_path / "data" / "_lock" / "run.lock"), "nightly-7"):
        res = _wheel_task("--conf", str(_conf(tmp_path)), "--only", "curate")
    assert res.returncode == 3 and "run nightly-7" in res.stderr, res.stderr[-2000:]
    assert "SparkSession" not in res.stderr


def test_budget_breach_exits_4_and_a_crashed_stage_exits_1(tmp_path):
    _pictures(tmp_path / "p", 3)
    # Every prepare raises in lakeshard's own code (udfs/faults.py): internal errors,
    # over run.budgets.internal_error_rate.
    res = _wheel_task("--conf", str(_conf(tmp_path)), "--only", "curate",
                      env={"LAKESHARD_RAISE_AT": "prepare:convert"})
    assert res.returncode == 4, res.stderr[-3000:]
    assert "run.budgets.internal_error_rate" in res.stdout + res.stderr

    # A manifest whose Delta log is garbage: the curate stage itself raises.
    crash = tmp_path / "crash"
    log_dir = crash / "data" / "delta" / "manifest" / "_delta_log"
    log_dir.mkdir(parents=True)
    (log_dir / "00000000000000000000.json").write_text('{"garbage": ')
    _pictures(crash / "p", 1)
    res = _wheel_task("--conf", str(_conf(crash)), "--only", "curate")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "curate: FAILED" in res.stdout + res.stderr or "Traceback" in res.stderr


# ------------------------------------------------------------------ versions, extras


@pytest.mark.parametrize(("version", "message"), [
    ("4.0.0", None), ("4.0.2", None), ("4.1.4", None), ("4.1.0.dev1", None),
    ("3.5.3", "the Python data source API"), ("4.2.0", "supported: 4.0.x, 4.1.x"),
    ("5.0.0", "supported: 4.0.x, 4.1.x"), ("four", "unrecognised Spark version"),
])
def test_unsupported_spark_is_refused_naming_what_is_missing(version, message):
    from etl.errors import JarsMissingError, UnsupportedSparkError
    from etl.session import check_spark_version

    if message is None:
        check_spark_version(version)
        return
    with pytest.raises(UnsupportedSparkError, match=re.escape(message)) as err:
        check_spark_version(version)
    assert isinstance(err.value, JarsMissingError)  # the CLI's exit status 2


def test_a_missing_optional_module_names_its_extra():
    from etl.errors import MissingExtraError, require

    with pytest.raises(MissingExtraError,
                       match=re.escape("pip install 'lakeshard[search]'")):
        require("lakeshard_no_such_module", "search", "semantic search")
    assert require("json", "search", "x") is json


def test_udf_result_types_are_nullable_throughout_and_the_declared_ones_unchanged():
    from support import non_null_fields

    from udfs.arrow_types import nullable_type
    from udfs.fetch import FETCH_TYPE
    from udfs.images import PREPARED_TYPE

    for declared in (FETCH_TYPE, PREPARED_TYPE):
        before = declared.json()
        relaxed = nullable_type(declared)
        assert non_null_fields(declared) and non_null_fields(relaxed) == []
        assert [f.name for f in relaxed.fields] == declared.names
        assert [f.dataType.typeName() for f in relaxed.fields] == [
            f.dataType.typeName() for f in declared.fields]
        assert declared.json() == before

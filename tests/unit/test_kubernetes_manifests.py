"""deploy/kubernetes/: every manifest is valid for one pinned Kubernetes API (kubernetes-validate,
strict: an unknown field is an error), and what the schemas cannot see holds: the daemon's and
the example job's command lines parse with elasticd's own parser and agree on the socket, the
probes name real routes, the token comes from a Secret that no manifest holds, the job's pod is
not root, and the node-labels helper writes a config file the daemon reads.

Nothing here ran on a cluster (none runs in CI): the manifests are checked on paper.
"""

from __future__ import annotations

import copy
import fnmatch
import http.server
import importlib.util
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest
import yaml

from api.auth import PUBLIC_PATHS
from elasticd.cli import build_parser
from elasticd.config import Config, load_config
from elasticd.models import JOB_ID_PATTERN, JobSpec

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
#: The Kubernetes version the manifests are written for (kubernetes-validate's newest).
KUBERNETES = "1.31.0"
#: What `$(VAR)` stands for when a command line is parsed here (the kubelet's expansion).
FIELD_VALUES = {
    "spec.nodeName": "gpu-node-7",
    "status.hostIP": "10.0.3.7",
    "metadata.name": "elasticd-store-0",
    "metadata.labels['batch.kubernetes.io/controller-uid']": "0b6e4c3e-8f47-4c1e-9a52-1f0d3c7b2a91",
}


def documents() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) for every YAML document under deploy/kubernetes/, in file order."""
    found = []
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), f"{path.name}: a document that is not an object"
            found.append((path.name, doc))
    return found


def the(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``)."""
    matches = [
        doc
        for _, doc in documents()
        if doc["kind"] == kind and name in (None, doc["metadata"]["name"])
    ]
    assert len(matches) == 1, f"{len(matches)} objects of kind {kind} named {name}"
    return matches[0]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    every = pod.get("initContainers", []) + pod["containers"]
    (found,) = [c for c in every if c["name"] == name]
    return found


def argv(c: dict[str, Any]) -> list[str]:
    """The container's command line as the kubelet runs it: each ``$(VAR)`` replaced by the
    value of the container's env entry of that name; an undefined one fails."""
    env = {}
    for entry in c.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            env[entry["name"]] = FIELD_VALUES[entry["valueFrom"]["fieldRef"]["fieldPath"]]

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"{c['name']}: $({match.group(1)}) is not in its env"
        return env[match.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, word) for word in c["command"]]


def parsed(words: list[str]) -> Any:
    """``words`` (``elasticd ...``) through elasticd's own parser; a refusal fails the test."""
    assert words[0] == "elasticd", words
    try:
        return build_parser().parse_args(words[1:])
    except SystemExit as exc:  # argparse's refusal (it has printed why)
        pytest.fail(f"elasticd's parser refuses {words[1:]}: exit {exc.code}")


def mount_of(pod: dict[str, Any], c: dict[str, Any], path: str) -> tuple[dict, dict]:
    """(the volume mount holding ``path`` in ``c``, its volume)."""
    mounts = [m for m in c.get("volumeMounts", []) if (path + "/").startswith(m["mountPath"] + "/")]
    assert mounts, f"{c['name']}: nothing is mounted at {path}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def node_labels_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("node_labels", DEPLOY / "node_labels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def daemon_pod() -> dict[str, Any]:
    return the("DaemonSet", "elasticd")["spec"]["template"]["spec"]


def job_pod() -> dict[str, Any]:
    return the("Job")["spec"]["template"]["spec"]


# -- the schemas ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param(doc, id=f"{name}:{doc['kind']}/{doc['metadata']['name']}")
        for name, doc in documents()
    ],
)
def test_every_manifest_is_valid_for_the_pinned_kubernetes_api(doc):
    """Each object validates strictly against its kind's schema of Kubernetes 1.31; a kind
    without a schema there (a typo, a CRD) fails too."""
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_folder_holds_every_piece():
    """The DaemonSet, its RBAC, its config, the store, the example Job and the policy are there."""
    kinds = sorted({doc["kind"] for _, doc in documents()})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
        "Job",
        "Namespace",
        "Service",
        "ServiceAccount",
        "StatefulSet",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]


def test_strict_validation_refuses_an_unknown_field_and_an_unknown_kind():
    """The validation above can fail: a misspelt field of the DaemonSet and a kind Kubernetes
    does not have are both refused."""
    daemonset = copy.deepcopy(the("DaemonSet", "elasticd"))
    daemonset["spec"]["template"]["spec"]["hostPIDs"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPIDs"):
        kubernetes_validate.validate(daemonset, KUBERNETES, strict=True)
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        kubernetes_validate.validate({**daemonset, "kind": "DaemonSets"}, KUBERNETES, strict=True)


# -- the node daemon -----------------------------------------------------------------


def test_the_daemonsets_command_is_a_serve_that_elasticds_parser_accepts(tmp_path):
    """`elasticd serve` with the node's name and address from the downward API, and a config
    that elasticd's own Config accepts once the init container has added the node's labels."""
    pod = daemon_pod()
    c = container(pod, "elasticd")
    args = parsed(argv(c))
    assert args.command == "serve" and not args.store_only and not args.check
    assert args.node_name == FIELD_VALUES["spec.nodeName"]
    assert args.host == args.advertise_addr == FIELD_VALUES["status.hostIP"]
    init = node_labels_module().build_parser().parse_args(argv(container(pod, "node-labels"))[1:])
    assert Path(args.config) == init.config_out, "the daemon reads another config than is written"
    _, volume = mount_of(pod, c, args.config)
    assert "emptyDir" in volume, "the written config is not the init container's output"
    _, source = mount_of(pod, container(pod, "node-labels"), str(init.config_in))
    configmap = the("ConfigMap", source["configMap"]["name"])
    text = configmap["data"][init.config_in.name]
    written = node_labels_module().with_labels(text, {"elasticd.io/node": "true"})
    config_file = tmp_path / "elasticd.toml"
    config_file.write_text(written)
    flags = {k: getattr(args, k) for k in ("host", "port", "node_name", "labels", "unix_socket")}
    config = load_config({**flags, "config": str(config_file)}, environ={})
    assert config.labels == {"elasticd.io/node": "true"}
    assert config.containment == "cgroup"


def test_the_daemon_shares_the_hosts_pids_and_runs_privileged_with_no_limits():
    """hostPID, the host's network, privileged (setresuid, a writable cgroupfs, /dev/kmsg),
    no resource limits (its workers live in its cgroup), and no hostPath of /sys/fs/cgroup
    (it would not be the subtree the daemon's /proc/self/cgroup names)."""
    pod = daemon_pod()
    c = container(pod, "elasticd")
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert c["securityContext"]["privileged"] is True
    assert "limits" not in c["resources"] and c["resources"]["requests"]
    host_paths = [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v]
    assert not any(p.startswith("/sys/fs/cgroup") for p in host_paths)


def test_the_daemons_state_logs_and_socket_are_on_the_host():
    """The state and log folders and the socket's folder are hostPaths, at the paths of the
    command line; the socket is in the folder the host path shares."""
    pod = daemon_pod()
    c = container(pod, "elasticd")
    args = parsed(argv(c))
    for path in (args.state_dir, args.log_dir, str(Path(args.unix_socket).parent)):
        mount, volume = mount_of(pod, c, path)
        assert mount["mountPath"] == path and volume["hostPath"]["path"] == path, path
        assert not mount.get("readOnly"), path


def test_the_grace_covers_the_daemons_own_stop():
    """terminationGracePeriodSeconds exceeds a job's default termination_grace plus the
    daemon's shutdown_timeout: the kubelet's SIGKILL never cuts the daemon's stop short."""
    grace = JobSpec.model_fields["termination_grace"].default
    shutdown = Config.model_fields["shutdown_timeout"].default
    assert daemon_pod()["terminationGracePeriodSeconds"] > grace + shutdown


def test_an_image_change_never_rolls_over_running_workers_by_itself():
    """OnDelete: replacing the pod kills its node's workers, so an admin picks the moment."""
    assert the("DaemonSet", "elasticd")["spec"]["updateStrategy"] == {"type": "OnDelete"}


def test_the_probes_name_routes_of_the_daemon():
    """Liveness is /healthz on the daemon's port (a route that needs no identity); readiness
    asks /readyz on the daemon's own socket (it needs one: root there is the node's admin)."""
    pod = daemon_pod()
    c = container(pod, "elasticd")
    args = parsed(argv(c))
    paths = json.loads((ROOT / "openapi.json").read_text())["paths"]
    live = c["livenessProbe"]["httpGet"]
    assert live["path"] in paths and live["path"] in PUBLIC_PATHS
    assert live["port"] == args.port == c["ports"][0]["containerPort"]
    ready = c["readinessProbe"]["exec"]["command"]
    assert ready[0] == "curl" and "--fail" in ready
    assert ready[ready.index("--unix-socket") + 1] == args.unix_socket
    url = ready[-1]
    assert url.startswith("http://localhost/") and url.removeprefix("http://localhost") in paths
    assert "/readyz" in url


def test_the_token_comes_from_a_secret_no_manifest_holds():
    """--token-file is in a Secret volume (0400: the daemon refuses a token others may read);
    no manifest is a Secret or carries a token in a probe header or an env value."""
    assert not [name for name, doc in documents() if doc["kind"] == "Secret"]
    for kind, name in (("DaemonSet", "elasticd"), ("StatefulSet", "elasticd-store")):
        pod = the(kind, name)["spec"]["template"]["spec"]
        c = pod["containers"][0]
        args = parsed(argv(c))
        mount, volume = mount_of(pod, c, args.token_file)
        assert volume["secret"]["secretName"] == "elasticd-token", name
        assert volume["secret"]["defaultMode"] == 0o400 and mount["readOnly"] is True, name
    text = "\n".join(p.read_text() for p in DEPLOY.rglob("*.y*ml"))
    assert "httpHeaders" not in text and "Bearer" not in text


def test_only_the_init_container_gets_the_api_token():
    """The pod mounts no account token by itself; the projected one is the init container's
    only, so no worker (they run in the daemon's container) can read it."""
    pod = daemon_pod()
    assert pod["automountServiceAccountToken"] is False
    projected = {v["name"] for v in pod["volumes"] if "projected" in v}
    assert projected
    daemon_mounts = {m["name"] for m in container(pod, "elasticd")["volumeMounts"]}
    assert not projected & daemon_mounts
    assert projected <= {m["name"] for m in container(pod, "node-labels")["volumeMounts"]}


def test_rbac_grants_the_daemons_account_only_get_on_nodes():
    """The ClusterRole is `get nodes` and nothing else, bound to the DaemonSet's account."""
    role = the("ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    binding = the("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    daemonset = the("DaemonSet", "elasticd")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": daemon_pod()["serviceAccountName"],
            "namespace": daemonset["metadata"]["namespace"],
        }
    ]


def test_the_store_is_what_the_daemons_config_names(tmp_path):
    """The daemons' store_url is the store Service's, on the port the store serves."""
    store = container(the("StatefulSet")["spec"]["template"]["spec"], "store")
    args = parsed(argv(store))
    assert args.command == "serve" and args.store_only
    service = the("Service", "elasticd-store")
    text = the("ConfigMap", "elasticd-config")["data"]["elasticd.toml"]
    config_file = tmp_path / "elasticd.toml"
    config_file.write_text(text)
    config = load_config({"config": str(config_file)}, environ={})
    namespace = service["metadata"]["namespace"]
    port = service["spec"]["ports"][0]["port"]
    assert config.store_url == f"http://{service['metadata']['name']}.{namespace}.svc:{port}"
    assert port == args.port


# -- the example job -----------------------------------------------------------------


def test_the_example_job_submits_and_waits_through_the_nodes_socket():
    """`elasticd submit --wait` on the socket the daemon listens on, through a read-only
    hostPath of the daemon's socket folder; the id, one per Kubernetes Job, is a valid job id."""
    pod = job_pod()
    c = container(pod, "submit")
    args = parsed(argv(c))
    assert args.command == "submit" and args.wait and args.program[:1] == ["--"]
    assert args.url is None and args.token_file is None, "the pod must need no token"
    daemon = parsed(argv(container(daemon_pod(), "elasticd")))
    assert args.socket == daemon.unix_socket
    mount, volume = mount_of(pod, c, str(Path(args.socket).parent))
    assert mount["readOnly"] is True
    assert volume["hostPath"]["path"] == str(Path(daemon.unix_socket).parent)
    assert re.fullmatch(JOB_ID_PATTERN, args.job_id), args.job_id
    assert "$(" in c["command"][c["command"].index("--id") + 1], "one id for every run"


def test_the_example_jobs_pod_is_not_root_and_holds_no_secret():
    """runAsNonRoot with a uid that the admission policy's namespace label names and the image
    makes a user of; no container asks for root, privilege or the account's token."""
    pod = job_pod()
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] > 0
    for c in pod["containers"] + pod.get("initContainers", []):
        assert c.get("securityContext", {}).get("runAsUser", security["runAsUser"]) > 0
        assert not c.get("securityContext", {}).get("privileged")
        assert not c.get("envFrom") and all("secretKeyRef" not in str(e) for e in c.get("env", []))
    assert pod["automountServiceAccountToken"] is False
    assert not [v for v in pod["volumes"] if "secret" in v or "projected" in v]
    namespace = the("Namespace", the("Job")["metadata"]["namespace"])
    assert namespace["metadata"]["labels"]["elasticd.io/uid"] == str(security["runAsUser"])
    binding = the("ValidatingAdmissionPolicyBinding")
    selector = binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]
    assert selector.items() <= namespace["metadata"]["labels"].items()
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"--uid {security['runAsUser']} " in dockerfile, "the daemon would not know the user"


def test_the_example_jobs_selector_is_a_label_the_daemons_take_from_their_node():
    """Each --selector key is one the node-labels helper copies, and the job's pods go to
    nodes that carry it."""
    args = parsed(argv(container(job_pod(), "submit")))
    init = (
        node_labels_module()
        .build_parser()
        .parse_args(argv(container(daemon_pod(), "node-labels"))[1:])
    )
    patterns = init.keys.split(",")
    assert args.selector
    for item in args.selector:
        key, _, value = item.partition("=")
        assert any(fnmatch.fnmatchcase(key, p) for p in patterns), key
        assert job_pod()["nodeSelector"].get(key) == value
        assert daemon_pod()["nodeSelector"].get(key) == value


# -- the image -----------------------------------------------------------------------


def test_the_dockerfile_copies_what_exists_and_installs_the_helper_the_init_runs():
    """Every COPY source is in the repository (the build context is its root), the helper is
    installed under the name the init container runs, and every manifest uses one image."""
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), source
    helper = container(daemon_pod(), "node-labels")["command"][0]
    assert any(line.startswith("COPY deploy/kubernetes/node_labels.py ") for line in lines)
    assert any(line.endswith(f"/usr/local/bin/{helper}") for line in lines), helper
    assert "torch" not in " ".join(
        line for line in lines if "pip install" in line and "EXTRAS" not in line
    )
    images = set()
    for _, doc in documents():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        images |= {c["image"] for c in spec.get("containers", []) + spec.get("initContainers", [])}
    assert len(images) == 1, images


# -- the node-labels helper, run ---------------------------------------------------------


class _FakeApi(http.server.BaseHTTPRequestHandler):
    """GET /api/v1/nodes/<name>: that Node (with labels) when the bearer token is right."""

    nodes: dict[str, dict[str, str]] = {}
    token = "sa-token"

    def do_GET(self) -> None:
        name = self.path.removeprefix("/api/v1/nodes/")
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self.send_response(401)
            body = b"{}"
        elif name not in self.nodes:
            self.send_response(404)
            body = b'{"kind": "Status", "reason": "NotFound"}'
        else:
            self.send_response(200)
            body = json.dumps(
                {"kind": "Node", "metadata": {"name": name, "labels": self.nodes[name]}}
            ).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_api() -> Iterator[str]:
    _FakeApi.nodes = {
        "gpu-node-7": {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "topology.kubernetes.io/zone": "eu-west-1b",
            "elasticd.io/node": "true",
            "kubernetes.io/hostname": "gpu-node-7",
            "beta.kubernetes.io/arch": "amd64",
        }
    }
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def run_helper(
    api: str, node: str, tmp_path: Path, token: str = "sa-token"
) -> tuple[int, str, Path]:
    """The helper as the init container runs it (its own flags), against ``api``."""
    init = container(daemon_pod(), "node-labels")
    words = argv(init)[1:]
    config_in = tmp_path / "in.toml"
    config_in.write_text(the("ConfigMap", "elasticd-config")["data"]["elasticd.toml"])
    out = tmp_path / "out" / "elasticd.toml"
    words[words.index("--config-in") + 1] = str(config_in)
    words[words.index("--config-out") + 1] = str(out)
    words[words.index("--node") + 1] = node
    (tmp_path / "token").write_text(token + "\n")
    words += ["--api", api, "--token-file", str(tmp_path / "token")]
    done = subprocess.run(
        [sys.executable, str(DEPLOY / "node_labels.py"), *words],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr, out


@pytest.mark.timeout(90)
def test_the_helper_writes_the_nodes_chosen_labels_into_a_config_the_daemon_reads(
    fake_api, tmp_path
):
    """Run against a fake API server: the labels its --keys match (and only those) end up in
    the daemon's settings, with the ConfigMap's settings kept."""
    code, output, out = run_helper(fake_api, "gpu-node-7", tmp_path)
    assert code == 0, output
    config = load_config({"config": str(out), "node_name": "gpu-node-7"}, environ={})
    assert config.labels == {
        "elasticd.io/node": "true",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "topology.kubernetes.io/zone": "eu-west-1b",
    }
    assert config.store_url == "http://elasticd-store.elasticd.svc:7070"


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("node", "token"), [("gpu-node-404", "sa-token"), ("gpu-node-7", "wrong")])
def test_the_helper_fails_and_writes_nothing_when_the_node_cannot_be_read(
    fake_api, tmp_path, node, token
):
    """An unknown node or a refused token: exit 1 naming the node, no config file, so the
    daemon's container never starts without its labels."""
    code, output, out = run_helper(fake_api, node, tmp_path, token=token)
    assert code == 1 and f"node {node}" in output
    assert not out.exists()


def test_the_helper_refuses_a_config_that_sets_labels_itself():
    """Two `labels` would be a TOML error at the daemon's start: the helper says so first."""
    helper = node_labels_module()
    with pytest.raises(ValueError, match="labels"):
        helper.with_labels('labels = "a=b"\n', {"c": "d"})
    assert 'labels = { "c" = "d" }' in helper.with_labels('run_as = "elasticd"\n', {"c": "d"})


# -- the admission policy ------------------------------------------------------------


def policy() -> dict[str, Any]:
    return the("ValidatingAdmissionPolicy")["spec"]


def refusals(pod: dict[str, Any], uid: str = "1000") -> list[str]:
    """The messages of the policy's validations that ``pod`` fails in a namespace labelled
    ``elasticd.io/uid=uid``: its CEL evaluated (variables first, in order) by a CEL library."""
    import cel  # common-expression-language: the CEL of cel-spec, not the API server's build

    context: dict[str, Any] = {
        "object": {"apiVersion": "v1", "kind": "Pod", "spec": pod},
        "namespaceObject": {"metadata": {"labels": {"elasticd.io/uid": uid}}},
    }
    variables: dict[str, Any] = {}
    for variable in policy()["variables"]:
        variables[variable["name"]] = cel.evaluate(
            variable["expression"], {**context, "variables": variables}
        )
    return [
        validation["message"].strip()
        for validation in policy()["validations"]
        if cel.evaluate(validation["expression"], {**context, "variables": variables}) is not True
    ]


def test_the_policy_matches_pods_and_their_ephemeral_containers():
    """`kubectl debug` adds a container through pods/ephemeralcontainers (an UPDATE): matched,
    as pods' creations and updates are."""
    (rule,) = policy()["matchConstraints"]["resourceRules"]
    assert {"pods", "pods/ephemeralcontainers"} <= set(rule["resources"])
    assert {"CREATE", "UPDATE"} <= set(rule["operations"])
    containers = next(v for v in policy()["variables"] if v["name"] == "containers")
    for field in ("containers", "initContainers", "ephemeralContainers"):
        assert f"object.spec.{field}" in containers["expression"], field


@pytest.mark.parametrize(
    "field",
    ["runAsUser", "runAsNonRoot", "allowPrivilegeEscalation", "capabilities.drop", "'ALL'"],
)
def test_a_validation_checks_each_field_that_keeps_a_container_its_uid(field):
    """Each field is read by a validation over every container (the variable above)."""
    assert any(
        field in v["expression"] and "variables.containers.all(" in v["expression"]
        for v in policy()["validations"]
    ), field


def test_the_example_jobs_containers_can_gain_no_privilege():
    """No privilege escalation, every capability dropped, non-root: what the policy demands."""
    pod = job_pod()
    for c in pod["containers"] + pod.get("initContainers", []):
        security = c["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, c["name"]
        assert "ALL" in security["capabilities"]["drop"] and "add" not in security["capabilities"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_policy_admits_the_example_jobs_pod():
    """Every validation holds of the example Job's pod, in its namespace."""
    namespace = the("Namespace", the("Job")["metadata"]["namespace"])
    assert refusals(job_pod(), namespace["metadata"]["labels"]["elasticd.io/uid"]) == []


def _attack(change: Any) -> dict[str, Any]:
    pod = copy.deepcopy(job_pod())
    change(pod, pod["containers"][0])
    return pod


def _debug_container(security: dict[str, Any] | None) -> Any:
    """An ephemeral container (`kubectl debug`) with ``security`` as its securityContext."""

    def change(pod: dict[str, Any], _: dict[str, Any]) -> None:
        debug = {"name": "debugger", "image": "busybox", "command": ["sh"]}
        if security is not None:
            debug["securityContext"] = security
        pod["ephemeralContainers"] = [debug]

    return change


_LOCKED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        pytest.param(
            lambda pod, c: c["securityContext"].pop("allowPrivilegeEscalation"),
            "allowPrivilegeEscalation",
            id="setuid-capable: allowPrivilegeEscalation unset",
        ),
        pytest.param(
            lambda pod, c: c["securityContext"].update(allowPrivilegeEscalation=True),
            "allowPrivilegeEscalation",
            id="allowPrivilegeEscalation true",
        ),
        pytest.param(
            lambda pod, c: c["securityContext"].pop("capabilities"),
            "capabilities",
            id="capabilities kept",
        ),
        pytest.param(
            lambda pod, c: c["securityContext"]["capabilities"].update(add=["SETUID"]),
            "capabilities",
            id="ALL dropped, SETUID added",
        ),
        pytest.param(
            lambda pod, c: c["securityContext"].update(runAsUser=0, runAsNonRoot=False),
            "elasticd.io/uid",
            id="a container as root",
        ),
        pytest.param(
            lambda pod, c: pod["securityContext"].pop("runAsNonRoot"),
            "runAsNonRoot",
            id="runAsNonRoot unset",
        ),
        pytest.param(
            lambda pod, c: pod["securityContext"].update(runAsUser=1001),
            "elasticd.io/uid",
            id="another uid",
        ),
        pytest.param(
            _debug_container({**_LOCKED, "runAsUser": 0}),
            "elasticd.io/uid",
            id="ephemeral container as root",
        ),
        pytest.param(
            _debug_container(None),
            "allowPrivilegeEscalation",
            id="ephemeral container with no securityContext",
        ),
        pytest.param(
            lambda pod, c: pod.setdefault("initContainers", []).append(
                {"name": "setup", "image": "busybox", "securityContext": {"runAsUser": 1000}}
            ),
            "allowPrivilegeEscalation",
            id="init container that may escalate",
        ),
    ],
)
def test_the_policy_refuses_a_pod_that_could_reach_the_socket_as_another_user(change, refused):
    """Each attack on the example pod is refused, by the validation that names its field."""
    found = refusals(_attack(change))
    assert any(refused in message for message in found), found


def test_a_locked_ephemeral_container_as_the_namespaces_uid_is_admitted():
    """`kubectl debug` stays possible: an ephemeral container as locked down as the pod's."""
    assert refusals(_attack(_debug_container({**_LOCKED, "runAsNonRoot": True}))) == []

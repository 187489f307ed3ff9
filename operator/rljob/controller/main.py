"""`rljob-operator`: runs kopf with our handlers and options. Credentials and the operator's own calls:
the shared client (rljob.kubeclient), built with the operator's call counter (controller/kube.py)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource

from prometheus_client import start_http_server

from rljob import event_loop
from rljob.controller import heap
from rljob.controller.children import AgentOptions, native_sidecars_supported
from rljob.controller.conductor import ConductorOptions
from rljob.controller.kube import Kube, api_server
from rljob.controller.leader import ElectionOptions, LeaderElector
from rljob.controller.namespace_watch import keep_watching_terminating_namespaces
from rljob.kubeclient.apiserver import ApiServer

log = logging.getLogger("rljob")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="rljob-operator", description=__doc__)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="namespace to watch (repeatable; globs allowed)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument("--agent-image", default=env("RLJOB_AGENT_IMAGE", AgentOptions.image))
    p.add_argument("--agent-image-pull-policy", default=env("RLJOB_AGENT_IMAGE_PULL_POLICY", "IfNotPresent"))
    p.add_argument(
        "--agent-gpu-probe",
        default=env("RLJOB_AGENT_GPU_PROBE", "nvml"),
        help="the agents' --gpu-probe: `nvml`, or a plugin `package.module:factory` (simulated pods)",
    )
    p.add_argument(
        "--agent-gpu-visibility",
        choices=("claim", "all"),
        default=env("RLJOB_AGENT_GPU_VISIBILITY", "claim"),
        help="claim: the agent shares the rollout container's DRA claim and sees only its GPUs; all: "
        "NVIDIA_VISIBLE_DEVICES=all on the agent (classic device plugin, runtimes that accept it), which "
        "then verifies the GPUs a pod process names (docs/agent.md, 'The GPUs of this pod')",
    )
    p.add_argument(
        "--agent-sidecar",
        choices=("auto", "native", "container"),
        default=env("RLJOB_AGENT_SIDECAR", "auto"),
        help="how the agent is injected: `native` (an init container with restartPolicy Always: its restart "
        "keeps the pod and it recovers its state), `container` (a regular container: its exit restarts "
        "the gang), `auto` (native where the API server's /version is 1.33 or newer)",
    )
    p.add_argument("--metrics-port", type=int, default=int(env("RLJOB_METRICS_PORT", "9090")), help="0: off")
    p.add_argument(
        "--metrics-address",
        default=env("RLJOB_METRICS_ADDRESS", "0.0.0.0"),
        help="listen address of the metrics endpoint",
    )
    p.add_argument("--health-endpoint", default=env("RLJOB_HEALTH_ENDPOINT", "http://0.0.0.0:8080/healthz"))
    p.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=env("RLJOB_LEADER_ELECT", "0") == "1",
        help="run as one of several replicas: act only while holding the Lease (controller/leader.py)",
    )
    p.add_argument(
        "--leader-elect-namespace",
        default=env("POD_NAMESPACE", "default"),
        help="namespace of the Lease (env POD_NAMESPACE)",
    )
    p.add_argument("--leader-elect-name", default="rljob-operator", help="name of the Lease")
    p.add_argument(
        "--leader-elect-identity", default=env("POD_NAME", ""), help="this replica's name (env POD_NAME)"
    )
    p.add_argument("--leader-elect-lease-seconds", type=float, default=15.0)
    p.add_argument("--leader-elect-renew-deadline-seconds", type=float, default=10.0)
    p.add_argument("--leader-elect-retry-seconds", type=float, default=2.0)
    p.add_argument(
        "--tick-seconds", type=float, default=2.0, help="how soon what did not go through is tried again"
    )
    p.add_argument("--log-json", action="store_true", default=env("RLJOB_LOG_JSON") == "1")
    p.add_argument("--verbose", "-v", action="store_true")
    return p.parse_args(argv)


def _native_sidecar(choice: str, server: ApiServer) -> bool:
    """`auto`: ask the API server's /version (a failure to ask is not fatal: a regular container works
    on every server, it only restarts the gang when the agent exits)."""
    if choice != "auto":
        return choice == "native"
    try:
        version = str(json.loads(server.call_sync("get_version", "GET", "/version"))["gitVersion"])
    except Exception as e:  # any failure: the layout that works everywhere
        log.warning("cannot read the API server's /version (%s): the agent runs as a regular container", e)
        return False
    native = native_sidecars_supported(version)
    log.info(
        "API server %s: the agent runs as %s",
        version,
        "a native sidecar (it restarts without ending the pod)"
        if native
        else "a regular container (native sidecars need 1.33+; its exit restarts the gang)",
    )
    return native


NOFILE_CEILING = 1 << 20  # the soft limit asked for when the hard one is unlimited (Linux's default nr_open)


def raise_open_file_limit() -> tuple[int, int]:
    """The soft limit on open files raised to the hard one, as Go's runtime does at start: the operator
    holds a channel to every agent it conducts, and a common soft default, 1,024, is one RLJob's largest
    gang (spec.replicas). Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = NOFILE_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as err:  # a ceiling above the kernel's nr_open: keep the soft limit
            log.warning("open files: soft limit %d kept (%s)", soft, err)
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import kopf

    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_json else kopf.LogFormat.PLAIN,
    )
    logging.getLogger("rljob").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:  # "Handler 'x' succeeded" per watch event drowns the phase log
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    before, after = raise_open_file_limit()
    log.info("open files: soft limit %d (was %d)", after, before)
    server = api_server()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_address)
    from rljob.controller import handlers  # noqa: F401  (registers the handlers)

    keep_watching_terminating_namespaces()
    heap.trim_every()

    options = ConductorOptions(
        agent=AgentOptions(
            image=args.agent_image,
            image_pull_policy=args.agent_image_pull_policy,
            gpu_probe=args.agent_gpu_probe,
            gpu_visibility=args.agent_gpu_visibility,
            native_sidecar=_native_sidecar(args.agent_sidecar, server),
        ),
        tick_seconds=args.tick_seconds,
        freeze_heap=True,
    )
    elector = None
    if args.leader_elect:
        elector = LeaderElector(
            ElectionOptions(
                namespace=args.leader_elect_namespace,
                name=args.leader_elect_name,
                identity=args.leader_elect_identity,
                lease_seconds=args.leader_elect_lease_seconds,
                renew_deadline_seconds=args.leader_elect_renew_deadline_seconds,
                retry_seconds=args.leader_elect_retry_seconds,
            ),
            server,
        )
        logging.getLogger("rljob").info("standby: waiting for the lease %s", args.leader_elect_name)
        elector.acquire()
    try:
        with event_loop.runner() as runner:
            kopf.run(
                loop=runner.get_loop(),
                clusterwide=args.all_namespaces or not args.namespace,
                namespaces=args.namespace,
                standalone=True,  # no kopf peering: the Lease above decides which replica acts
                liveness_endpoint=args.health_endpoint or None,
                memo=kopf.Memo(kube=Kube(server), options=options),
            )
    finally:
        if elector is not None:
            elector.release()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""ops_k8s_check.py MANIFEST EXIT_STATUS_H OUT_DIR

Checks deploy/k8s/moetrain.yaml offline (no cluster to ask): a schema of the
fields it uses (every key is one the Kubernetes API defines at that place,
so a typo fails), and the facts that tie the objects to each other and to
moetraind: selectors and labels, named ports, probe ports, volumes and the
Secret, ConfigMap and claim they name, the token and job paths, the
podFailurePolicy exit codes against service/exit_status.h, the grace period
against the job's train.term_grace_s. Writes what the container would run
(command, args, env, job.json) to OUT_DIR for the test to run it for real.
Exit 0 when all hold; otherwise prints each problem and exits 1.
"""
import json
import os
import re
import sys

import yaml

manifest, exit_h, out = sys.argv[1:4]
problems = []


def bad(msg):
    problems.append(msg)


# The keys the Kubernetes API (v1.27+) defines, for the objects used here.
META = {"name", "namespace", "labels", "annotations", "generateName"}
SCHEMA = {
    "Secret": {"apiVersion", "kind", "metadata", "type", "data", "stringData", "immutable"},
    "ConfigMap": {"apiVersion", "kind", "metadata", "data", "binaryData", "immutable"},
    "PersistentVolumeClaim": {"apiVersion", "kind", "metadata", "spec"},
    "PersistentVolumeClaim.spec": {"accessModes", "resources", "storageClassName", "volumeMode",
                                   "selector", "volumeName", "dataSource"},
    "Service": {"apiVersion", "kind", "metadata", "spec"},
    "Service.spec": {"clusterIP", "selector", "ports", "type", "publishNotReadyAddresses",
                     "sessionAffinity", "ipFamilies", "ipFamilyPolicy"},
    "ServicePort": {"name", "port", "targetPort", "protocol", "appProtocol", "nodePort"},
    "Job": {"apiVersion", "kind", "metadata", "spec"},
    "Job.spec": {"completionMode", "completions", "parallelism", "backoffLimit",
                 "podFailurePolicy", "template", "activeDeadlineSeconds", "ttlSecondsAfterFinished",
                 "suspend", "backoffLimitPerIndex", "maxFailedIndexes", "selector",
                 "manualSelector"},
    "PodFailurePolicyRule": {"action", "onExitCodes", "onPodConditions"},
    "onExitCodes": {"containerName", "operator", "values"},
    "PodTemplate": {"metadata", "spec"},
    "PodSpec": {"subdomain", "hostname", "restartPolicy", "terminationGracePeriodSeconds",
                "containers", "initContainers", "volumes", "nodeSelector", "tolerations",
                "affinity", "serviceAccountName", "securityContext", "priorityClassName",
                "schedulerName", "setHostnameAsFQDN"},
    "Container": {"name", "image", "command", "args", "env", "envFrom", "ports", "startupProbe",
                  "livenessProbe", "readinessProbe", "resources", "volumeMounts", "workingDir",
                  "securityContext", "imagePullPolicy", "lifecycle"},
    "EnvVar": {"name", "value", "valueFrom"},
    "ContainerPort": {"name", "containerPort", "protocol", "hostPort"},
    "Probe": {"grpc", "httpGet", "tcpSocket", "exec", "initialDelaySeconds", "periodSeconds",
              "timeoutSeconds", "failureThreshold", "successThreshold",
              "terminationGracePeriodSeconds"},
    "GRPCAction": {"port", "service"},
    "Resources": {"requests", "limits", "claims"},
    "VolumeMount": {"name", "mountPath", "readOnly", "subPath"},
    "Volume": {"name", "persistentVolumeClaim", "configMap", "secret", "emptyDir", "hostPath"},
}
KINDS = {("v1", "Secret"), ("v1", "ConfigMap"), ("v1", "PersistentVolumeClaim"),
         ("v1", "Service"), ("batch/v1", "Job")}


def keys(obj, schema, where):
    if not isinstance(obj, dict):
        bad("%s: expected a mapping, got %r" % (where, obj))
        return
    for k in obj:
        if k not in SCHEMA[schema]:
            bad("%s: unknown field '%s' (a %s has: %s)" % (where, k, schema,
                                                           ", ".join(sorted(SCHEMA[schema]))))


docs = [d for d in yaml.safe_load_all(open(manifest)) if d]
by_kind = {}
for d in docs:
    kind = d.get("kind")
    if (d.get("apiVersion"), kind) not in KINDS:
        bad("%s %s: unexpected apiVersion/kind" % (d.get("apiVersion"), kind))
        continue
    keys(d, kind, kind)
    meta = d.get("metadata", {})
    if not meta.get("name"):
        bad("%s: metadata.name is required" % kind)
    for k in meta:
        if k not in META:
            bad("%s: unknown metadata field '%s'" % (kind, k))
    by_kind.setdefault(kind, []).append(d)
for kind in ("Secret", "ConfigMap", "PersistentVolumeClaim", "Service", "Job"):
    if kind not in by_kind:
        bad("no %s" % kind)
if problems:
    print("\n".join(problems))
    sys.exit(1)


def named(kind, name):
    return any(d["metadata"]["name"] == name for d in by_kind.get(kind, []))


# exit statuses from the header the daemon is built with
codes = dict(re.findall(r"(MT_EXIT_\w+)\s*=\s*(\d+)", open(exit_h).read()))
permanent = sorted(int(codes[k]) for k in ("MT_EXIT_USAGE", "MT_EXIT_FAILED"))

svc = by_kind["Service"][0]
keys(svc["spec"], "Service.spec", "Service.spec")
for p in svc["spec"].get("ports", []):
    keys(p, "ServicePort", "Service.spec.ports")
if svc["spec"].get("clusterIP") != "None":
    bad("Service %s: must be headless (clusterIP: None) for the pods' DNS names"
        % svc["metadata"]["name"])
pvc = by_kind["PersistentVolumeClaim"][0]
keys(pvc["spec"], "PersistentVolumeClaim.spec", "PersistentVolumeClaim.spec")

job = by_kind["Job"][0]
js = job["spec"]
keys(js, "Job.spec", "Job.spec")
if js.get("completionMode") != "Indexed":
    bad("Job: completionMode must be Indexed (JOB_COMPLETION_INDEX is the rank)")
if js.get("completions") != js.get("parallelism"):
    bad("Job: completions and parallelism must both be the number of ranks")
if js.get("parallelism") != 1:
    bad("Job: this build runs one pod per job (moetrain-rank.sh refuses more)")
if not isinstance(js.get("backoffLimit"), int) or js["backoffLimit"] < 1:
    bad("Job: backoffLimit >= 1: exit 75 must be retried (with --resume auto)")
rules = js.get("podFailurePolicy", {}).get("rules", [])
fail_codes = []
for r in rules:
    keys(r, "PodFailurePolicyRule", "podFailurePolicy.rules")
    if "onExitCodes" in r:
        keys(r["onExitCodes"], "onExitCodes", "podFailurePolicy.rules.onExitCodes")
    if r.get("action") == "FailJob" and "onExitCodes" in r:
        fail_codes += r["onExitCodes"].get("values", [])
if sorted(fail_codes) != permanent:
    bad("podFailurePolicy: FailJob on exit codes %s, exit_status.h says %s are permanent"
        % (sorted(fail_codes), permanent))
if int(codes["MT_EXIT_RESTART"]) in fail_codes:
    bad("podFailurePolicy: %s (restart) must be retried" % codes["MT_EXIT_RESTART"])
if not any(r.get("action") == "Ignore" and
           any(c.get("type") == "DisruptionTarget" for c in r.get("onPodConditions", []))
           for r in rules):
    bad("podFailurePolicy: preemption (DisruptionTarget) should not count as a failure")

tpl = js["template"]
keys(tpl, "PodTemplate", "Job.spec.template")
pod = tpl["spec"]
keys(pod, "PodSpec", "pod spec")
labels = tpl.get("metadata", {}).get("labels", {})
for k, v in svc["spec"].get("selector", {}).items():
    if labels.get(k) != v:
        bad("Service selector %s=%s does not match the pod labels %s" % (k, v, labels))
if pod.get("subdomain") != svc["metadata"]["name"]:
    bad("pod subdomain %r must be the headless Service's name %r"
        % (pod.get("subdomain"), svc["metadata"]["name"]))
if pod.get("restartPolicy") != "Never":
    bad("restartPolicy must be Never (podFailurePolicy requires it)")
if len(pod.get("containers", [])) != 1:
    bad("one container per pod (the rank)")
c = pod["containers"][0]
keys(c, "Container", "container")
for e in c.get("env", []):
    keys(e, "EnvVar", "container.env")
for p in c.get("ports", []):
    keys(p, "ContainerPort", "container.ports")
for m in c.get("volumeMounts", []):
    keys(m, "VolumeMount", "container.volumeMounts")
keys(c.get("resources", {}), "Resources", "container.resources")
ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
for p in svc["spec"].get("ports", []):
    if p.get("targetPort") not in ports:
        bad("Service port %s: targetPort %r is no container port name (%s)"
            % (p.get("name"), p.get("targetPort"), sorted(ports)))
for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
    pr = c.get(probe)
    if not pr:
        bad("container: no %s" % probe)
        continue
    keys(pr, "Probe", probe)
    g = pr.get("grpc")
    if not g:
        bad("%s: must use grpc (grpc.health.v1)" % probe)
        continue
    keys(g, "GRPCAction", probe + ".grpc")
    if g.get("port") != ports.get("grpc"):
        bad("%s: port %r is not the grpc container port %r" % (probe, g.get("port"),
                                                               ports.get("grpc")))
    if g.get("service") not in (None, "", "moetrain.v1.Trainer"):
        bad("%s: service %r is not one moetraind's health service knows" % (probe, g["service"]))
for name, port in (("MOETRAIN_LISTEN", "grpc"), ("MOETRAIN_HTTP", "http")):
    if not env.get(name, "").endswith(":%s" % ports.get(port)):
        bad("env %s=%r does not listen on the %s container port %r" % (name, env.get(name), port,
                                                                     ports.get(port)))
ann = tpl.get("metadata", {}).get("annotations", {})
if ann.get("prometheus.io/port") != str(ports.get("http")):
    bad("prometheus.io/port %r is not the http port" % ann.get("prometheus.io/port"))

vols = {}
for v in pod.get("volumes", []):
    keys(v, "Volume", "volumes")
    vols[v["name"]] = v
mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
for name in mounts:
    if name not in vols:
        bad("volumeMount %s: no such volume" % name)
for name, v in vols.items():
    if "persistentVolumeClaim" in v and not named("PersistentVolumeClaim",
                                                  v["persistentVolumeClaim"]["claimName"]):
        bad("volume %s: no PersistentVolumeClaim %s" % (name, v["persistentVolumeClaim"]["claimName"]))
    if "configMap" in v and not named("ConfigMap", v["configMap"]["name"]):
        bad("volume %s: no ConfigMap %s" % (name, v["configMap"]["name"]))
    if "secret" in v and not named("Secret", v["secret"]["secretName"]):
        bad("volume %s: no Secret %s" % (name, v["secret"]["secretName"]))


def mounted_file(var, kind, key_holder):
    """env var `var` must name file `key` of a mounted ConfigMap / Secret."""
    path = env.get(var, "")
    for name, mp in mounts.items():
        v = vols.get(name, {})
        ref = v.get("configMap", {}).get("name") or v.get("secret", {}).get("secretName")
        if path.startswith(mp.rstrip("/") + "/") and ref:
            key = path[len(mp.rstrip("/")) + 1:]
            for d in by_kind.get(kind, []):
                if d["metadata"]["name"] == ref:
                    data = dict(d.get("data", {}) or {}, **(d.get("stringData", {}) or {}))
                    if key not in data:
                        bad("env %s=%s: %s %s has no key %s" % (var, path, kind, ref, key))
                    return data.get(key)
    bad("env %s=%r is not a file of a mounted %s" % (var, path, kind))
    return None


job_json = mounted_file("MOETRAIN_JOB", "ConfigMap", "job.json")
mounted_file("MOETRAIN_TOKEN_FILE", "Secret", "token")
work = env.get("MOETRAIN_WORKDIR", "")
if mounts.get("workdir") != work:
    bad("env MOETRAIN_WORKDIR=%r is not the workdir volume's mount %r" % (work, mounts.get("workdir")))
if env.get("MOETRAIN_WORLD_SIZE") != str(js.get("parallelism")):
    bad("env MOETRAIN_WORLD_SIZE=%r is not the Job's parallelism" % env.get("MOETRAIN_WORLD_SIZE"))
grace = pod.get("terminationGracePeriodSeconds", 30)
term = 25.0
if job_json:
    try:
        spec = json.loads(job_json)
        term = float(spec.get("train", {}).get("term_grace_s", 25))
    except ValueError as e:
        bad("ConfigMap job.json is not JSON: %s" % e)
if not term < grace:
    bad("train.term_grace_s %g must be below terminationGracePeriodSeconds %s" % (term, grace))

if problems:
    print("\n".join(problems))
    sys.exit(1)
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "command"), "w") as f:
    f.write("\n".join(c.get("command", []) + c.get("args", [])) + "\n")
with open(os.path.join(out, "env"), "w") as f:
    for k, v in env.items():
        f.write("%s=%s\n" % (k, v))
with open(os.path.join(out, "job.json"), "w") as f:
    f.write(job_json)
with open(os.path.join(out, "paths"), "w") as f:
    for name, mp in mounts.items():
        f.write("%s=%s\n" % (name, mp))
print("k8s manifest: %d objects, schema and cross-references OK" % len(docs))

#!/usr/bin/python3
"""test_monitoring_files.py - the Grafana dashboard, the Prometheus files
and the metric documentation name only what moetraind exports.

The exported names are the moetrain_* string literals of service/prom.c
(the one writer of /metrics). Checked:
  - every metric the Grafana dashboard, the alert rules and the scrape
    config's comments query is exported (a renamed metric fails here, not
    in an operator's empty panel);
  - the dashboard has a panel for every quantity the web page shows;
  - its panels have unique ids and use the data source variable;
  - deploy/prometheus/README.md's table lists exactly the exported names;
  - prometheus.yml scrapes /metrics and loads the rules file.

    test_monitoring_files.py SOURCE_DIR
"""
import json
import os
import re
import sys

import yaml  # Debian's python3-yaml (deploy/setup.sh)

SOURCE = sys.argv[1]
checks = 0


def ok(cond, what):
    global checks
    if not cond:
        print("FAIL:", what, file=sys.stderr)
        sys.exit(1)
    checks += 1
    print("ok -", what)


def read(*path):
    with open(os.path.join(SOURCE, *path)) as f:
        return f.read()


NAME = re.compile(r"\bmoetrain_[a-z0-9_]+")
exported = set(re.findall(r'"(moetrain_[a-z0-9_]+)', read("service", "prom.c")))
ok(len(exported) >= 30 and "moetrain_loss" in exported,
   "service/prom.c exports %d moetrain_* metrics" % len(exported))

# ---- Grafana ---------------------------------------------------------------------------
dash = json.loads(read("deploy", "grafana", "moetrain.json"))
exprs = []


def walk(panels):
    for p in panels:
        yield p
        yield from walk(p.get("panels", []))


panels = list(walk(dash["panels"]))
for p in panels:
    for t in p.get("targets", []):
        exprs.append((p["title"], t["expr"]))
for v in dash["templating"]["list"]:
    if v["type"] == "query":
        exprs.append(("variable " + v["name"], v["definition"]))
for a in dash["annotations"]["list"]:
    exprs.append(("annotation " + a["name"], a["expr"]))
used = {n for _, e in exprs for n in NAME.findall(e)}
unknown = sorted((t, n) for t, e in exprs for n in NAME.findall(e) if n not in exported)
ok(not unknown, "the Grafana dashboard queries only exported metrics (%d names, %d queries)%s"
   % (len(used), len(exprs), "" if not unknown else ": not exported: %r" % unknown))

page = ["moetrain_job_state", "moetrain_steps_total", "moetrain_job_target_steps",
        "moetrain_tokens_total", "moetrain_loss", "moetrain_valid_loss", "moetrain_mtp_loss",
        "moetrain_learning_rate", "moetrain_grad_norm", "moetrain_tokens_per_second",
        "moetrain_model_flops_per_second", "moetrain_mfu_ratio", "moetrain_step_duration_seconds",
        "moetrain_memory_in_use_bytes", "moetrain_memory_peak_bytes",
        "moetrain_skipped_steps_total", "moetrain_expert_load_max_ratio",
        "moetrain_expert_load_min_ratio", "moetrain_expert_load_cv",
        "moetrain_checkpoints_saved_total", "moetrain_checkpoint_last_step",
        "moetrain_rank_memory_in_use_bytes", "moetrain_rank_memory_peak_bytes",
        "moetrain_rank_compute_duration_seconds", "moetrain_rank_step_duration_seconds",
        "moetrain_slowest_rank", "moetrain_expert_tokens", "moetrain_router_bias"]
missing = [n for n in page if n not in used]
ok(not missing, "the dashboard has a panel for every quantity the web page shows%s"
   % ("" if not missing else ": missing %r" % missing))
ids = [p["id"] for p in panels]
ok(len(ids) == len(set(ids)), "panel ids are unique (%d panels)" % len(ids))
ok(all(p["datasource"]["uid"] == "${datasource}" for p in panels if p["type"] != "row"),
   "every panel reads the data source chosen in the variable")
ok(all("gridPos" in p for p in panels), "every panel has a place on the grid")

# ---- Prometheus ------------------------------------------------------------------------
conf = yaml.safe_load(read("deploy", "prometheus", "prometheus.yml"))
jobs = conf["scrape_configs"]
ok(any(j.get("metrics_path", "/metrics") == "/metrics" and j["static_configs"] for j in jobs),
   "prometheus.yml scrapes /metrics of a moetraind")
ok(conf["rule_files"] == ["moetrain-rules.yml"], "prometheus.yml loads moetrain-rules.yml")
rules = yaml.safe_load(read("deploy", "prometheus", "moetrain-rules.yml"))
rexprs = [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]
unknown = sorted((a, n) for a, e in rexprs for n in NAME.findall(e) if n not in exported)
ok(rexprs and not unknown, "the %d alert rules query only exported metrics%s"
   % (len(rexprs), "" if not unknown else ": %r" % unknown))

documented = set(re.findall(r"^\| `(moetrain_[a-z0-9_]+)` \|", read("deploy", "prometheus", "README.md"),
                            re.M))
ok(documented == exported, "deploy/prometheus/README.md documents exactly the exported metrics%s"
   % ("" if documented == exported else ": undocumented %r, not exported %r"
      % (sorted(exported - documented), sorted(documented - exported))))
print("test_monitoring_files: %d checks passed" % checks)

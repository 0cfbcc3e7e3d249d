#!/usr/bin/python3
"""test_web_assets.py - the dashboard's vendored uPlot is the one the npm
lock pins, unchanged.

service/web/package.json names the version, package-lock.json pins it
(with the tarball's sha512, checked by `npm ci` in vendor.sh), and
vendor/uplot/SOURCE records what vendor.sh copied: the version and each
file's sha256. Checked: the three versions agree, each vendored file has
its recorded sha256, and the minified script's banner names the same
version; and every file the build embeds exists (service/CMakeLists.txt's
MT_WEB_FILES). No network, no npm: CI builds from the vendored copy.

    test_web_assets.py SOURCE_DIR
"""
import hashlib
import json
import os
import re
import sys

WEB = os.path.join(sys.argv[1], "service", "web")
checks = 0


def ok(cond, what):
    global checks
    if not cond:
        print("FAIL:", what, file=sys.stderr)
        sys.exit(1)
    checks += 1
    print("ok -", what)


pkg = json.load(open(os.path.join(WEB, "package.json")))
lock = json.load(open(os.path.join(WEB, "package-lock.json")))
want = pkg["dependencies"]["uplot"]
ok(re.fullmatch(r"\d+\.\d+\.\d+", want), "package.json pins an exact uplot version (%s)" % want)
locked = lock["packages"]["node_modules/uplot"]
ok(locked["version"] == want and locked["integrity"].startswith("sha512-"),
   "package-lock.json locks uplot %s with a sha512 integrity" % locked["version"])
source = {}
hashes = {}
for line in open(os.path.join(WEB, "vendor", "uplot", "SOURCE")):
    if line.startswith("#") or not line.strip():
        continue
    if line.startswith("sha256 "):
        _, h, name = line.split()
        hashes[name] = h
    else:
        k, v = line.strip().split("=", 1)
        source[k] = v
ok(source.get("package") == "uplot" and source.get("version") == want,
   "vendor/uplot/SOURCE records uplot %s, the locked version" % source.get("version"))
for name in ("uPlot.iife.min.js", "uPlot.min.css", "LICENSE"):
    data = open(os.path.join(WEB, "vendor", "uplot", name), "rb").read()
    ok(hashes.get(name) == hashlib.sha256(data).hexdigest(),
       "vendor/uplot/%s has the sha256 vendor.sh recorded" % name)
banner = open(os.path.join(WEB, "vendor", "uplot", "uPlot.iife.min.js")).read(200)
ok("(v%s)" % want in banner, "the vendored script's banner says v%s" % want)

cm = open(os.path.join(sys.argv[1], "service", "CMakeLists.txt")).read()
files = re.findall(r'"(/[^"=]*)=([^"]+)"', cm)
ok(len(files) >= 5 and all(os.path.isfile(os.path.join(WEB, f)) for _, f in files),
   "every file the build embeds exists (%s)" % ", ".join(u for u, _ in files))
ok(not [f for _, f in files if "node_modules" in f], "the build embeds nothing from node_modules")
print("test_web_assets: %d checks passed" % checks)

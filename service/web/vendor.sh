#!/usr/bin/env bash
# service/web/vendor.sh - refresh the vendored uPlot from npm.
#
# package.json names the version, package-lock.json pins it (with the
# tarball's sha512, which `npm ci` checks). This script installs exactly
# that into node_modules/ (not committed), copies the built files the page
# uses into vendor/uplot/, and records their sha256 in vendor/uplot/SOURCE,
# which tests/test_web_assets.py compares with the lock file and the files.
# Run it after changing the version in package.json (npm install
# --save-exact uplot@X first, to update the lock); commit vendor/ with it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
npm ci --no-audit --no-fund
version=$(node -p 'require("./node_modules/uplot/package.json").version')
out=vendor/uplot
mkdir -p "$out"
for f in dist/uPlot.iife.min.js dist/uPlot.min.css LICENSE; do
  cp "node_modules/uplot/$f" "$out/$(basename "$f")"
done
{
  echo "# vendor/uplot: built files of the npm package uplot, copied by vendor.sh"
  echo "package=uplot"
  echo "version=$version"
  for f in uPlot.iife.min.js uPlot.min.css LICENSE; do
    echo "sha256 $(sha256sum "$out/$f" | cut -d' ' -f1) $f"
  done
} > "$out/SOURCE"
echo "vendor.sh: uplot $version in $out"

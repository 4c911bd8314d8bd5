#!/usr/bin/env bash
# The quick start lives in examples/quickstart/ (script, configs, summary); this keeps the old command working.
exec bash "$(dirname "$0")/../examples/quickstart/quickstart.sh" "$@"

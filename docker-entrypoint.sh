#!/bin/sh
# The image's entrypoint: `t5tpu ARGS`, the command line as usual (`docker run IMAGE train ...`,
# a Vertex AI custom job), except in a Vertex AI prediction container, which Vertex AI starts
# with AIP_HTTP_PORT set: there, given no command (nothing, or flags alone), it serves,
# `t5tpu serve --host=0.0.0.0 FLAGS`, the model coming from AIP_STORAGE_URI unless the flags
# name one. With no arguments at all elsewhere, it prints `t5tpu --help`.
set -e
if [ -n "${AIP_HTTP_PORT:-}" ]; then
  case "${1:-}" in
    "" | -*) exec t5tpu serve --host=0.0.0.0 "$@" ;;
  esac
fi
if [ "$#" -eq 0 ]; then
  set -- --help
fi
exec t5tpu "$@"

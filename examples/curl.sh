#!/bin/sh
# A chat completion with curl (make serve in another terminal). With --api-key set, export
# CADENZA_API_KEY first; CADENZA_BASE_URL points elsewhere than make serve's address.
set -eu
BASE_URL="${CADENZA_BASE_URL:-http://127.0.0.1:8000/v1}"
curl -sS "$BASE_URL/chat/completions" \
  -H "Content-Type: application/json" \
  -H "Authorization: Bearer ${CADENZA_API_KEY:-unused}" \
  -d '{
    "model": "'"${CADENZA_MODEL:-SmolLM2-135M-Instruct}"'",
    "messages": [{"role": "user", "content": "Say hello in French."}],
    "max_tokens": 32
  }'
echo

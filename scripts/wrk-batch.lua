-- wrk script: POST /v1/batch with OPS claim ops per request (default 100), every key unique (run
-- id, wrk thread id, per-thread counter), ttl_ms 86,400,000 like redis-benchmark's
-- SET ... NX EX 86400. Every answer must be 200 with OPS items of "outcome":"new"; a non-2xx
-- answer or an item that is not "new" (an error item, a duplicate) is counted and printed by
-- done() (a run with errors is not valid).
-- Usage: wrk -t2 -c50 -d10s --latency -s scripts/wrk-batch.lua URL -- [RUN_ID] [OPS] [NAMESPACE]
-- done() prints one line `WRK_RESULT {json}` for scripts/bench-http.sh.

local threads = {}
local setup_ops = 100

function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end

function init(args)
  local run = args[1] or string.format("%d-%d", os.time(), math.random(1, 1e9))
  ops = tonumber(args[2] or "100")
  local namespace = args[3] or "bench"
  head = '{"op":"claim","namespace":"' .. namespace .. '","key":"' .. run .. ':' .. tid .. ':'
  tail = '","ttl_ms":86400000}'
  n = 0
  non2xx = 0
  bad_items = 0
  parts = {}
  wrk.method = "POST"
  wrk.path = "/v1/batch"
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  for i = 1, ops do
    n = n + 1
    parts[i] = head .. n .. tail
  end
  return wrk.format(nil, nil, nil, '{"ops":[' .. table.concat(parts, ",", 1, ops) .. ']}')
end

function response(status, headers, body)
  if status < 200 or status > 299 then
    non2xx = non2xx + 1
    return
  end
  local found, at = 0, 1
  while true do
    local s, e = string.find(body, '"outcome":"new"', at, true)
    if not s then break end
    found = found + 1
    at = e + 1
  end
  bad_items = bad_items + (ops - found)
end

function done(summary, latency, requests)
  local non2xx_total, bad_total, ops_seen = 0, 0, setup_ops
  for _, t in ipairs(threads) do
    non2xx_total = non2xx_total + t:get("non2xx")
    bad_total = bad_total + t:get("bad_items")
    ops_seen = t:get("ops")
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {"ops_per_request":%d,"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,' ..
    '"max_us":%d,"non2xx":%d,"bad_items":%d,"socket_errors":%d}\n',
    ops_seen, summary.requests, summary.duration, latency:percentile(50),
    latency:percentile(99), latency.max, non2xx_total, bad_total,
    e.connect + e.read + e.write + e.timeout))
end

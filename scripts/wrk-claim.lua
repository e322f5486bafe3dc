-- wrk script: POST /v1/claim, one claim per request, every key unique (run id, wrk thread id,
-- per-thread counter), ttl_ms 86,400,000 like redis-benchmark's SET ... NX EX 86400.
-- Every answer must be 200 with "outcome":"new" (the key was never seen); anything else is
-- counted and printed by done() (a run with errors is not valid).
-- Usage: wrk -t2 -c50 -d10s --latency -s scripts/wrk-claim.lua URL -- [RUN_ID] [NAMESPACE]
-- done() prints one line `WRK_RESULT {json}` for scripts/bench-http.sh.

local threads = {}

function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end

function init(args)
  local run = args[1] or string.format("%d-%d", os.time(), math.random(1, 1e9))
  local namespace = args[2] or "bench"
  head = '{"namespace":"' .. namespace .. '","key":"' .. run .. ':' .. tid .. ':'
  tail = '","ttl_ms":86400000}'
  n = 0
  non2xx = 0
  not_new = 0
  wrk.method = "POST"
  wrk.path = "/v1/claim"
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  n = n + 1
  return wrk.format(nil, nil, nil, head .. n .. tail)
end

function response(status, headers, body)
  if status < 200 or status > 299 then
    non2xx = non2xx + 1
  elseif not string.find(body, '"outcome":"new"', 1, true) then
    not_new = not_new + 1
  end
end

function done(summary, latency, requests)
  local non2xx_total, not_new_total = 0, 0
  for _, t in ipairs(threads) do
    non2xx_total = non2xx_total + t:get("non2xx")
    not_new_total = not_new_total + t:get("not_new")
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {"ops_per_request":1,"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,' ..
    '"max_us":%d,"non2xx":%d,"bad_items":%d,"socket_errors":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.max, non2xx_total, not_new_total,
    e.connect + e.read + e.write + e.timeout))
end

-- dedupgate: dedupgate_core::decide, re-expressed for Redis. One call decides a run of
-- operations in order, each atomically (the whole script is one atomic step), on Redis's clock.
--
-- KEYS: per op two keys, the record R and its fence keeper F, both in one hash-tag slot.
-- ARGV[1]: how long (ms) a fence keeper outlives its record.
-- ARGV[2 + 6*i ..]: op code and five arguments; '' stands for "none" (every optional text
-- field is non-empty when given: the Rust side validated the op before sending it).
--   C ttl_ms lease_ms fingerprint owner new_token   claim
--   M ttl_ms fingerprint result_json                 mark
--   K token result_json ttl_ms                       complete
--   R token                                          release
--   X token lease_ms                                 extend
--   G                                                get
--   F                                                forget
--
-- A record R is a MessagePack array {state, fence, token, fingerprint, owner, created_at_ms,
-- expires_at_ms, lease_expires_at_ms, completed_at_ms, result_json} with `false` for none,
-- state 'i' (in_progress), 'c' (completed) or 'r' (released: a fence-keeping tombstone).
-- R expires at its expires_at_ms (PXAT), so Redis forgets it by itself; F keeps the last fence
-- a while longer so that a fence still increases if Redis's clock steps back after expiry.
--
-- Reply: one array per op:
--   {'N', token, fence, lease_expires_at_ms, expires_at_ms}   new claim (or same-owner re-claim)
--   {'D', record...}      duplicate (claim or mark)
--   {'M', record...}      new mark
--   {'K', record...}      completed (or a retried complete, answered unchanged)
--   {'R'}                 released
--   {'X', lease_expires_at_ms}
--   {'G', record...} or {'G'}   found or not
--   {'F', 1|0}            forgotten or not
--   {'E', 'lease_lost' | 'fingerprint_mismatch'}
-- where record... is state, fence, fingerprint, owner, created_at_ms, expires_at_ms,
-- lease_expires_at_ms, completed_at_ms, result_json (false for none); times and fences are
-- integer replies.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fence_keep_ms = tonumber(ARGV[1])
local FENCE_PER_MS = 1000

local function n2s(n)
  return string.format('%.0f', n)
end

local function opt(s)
  if s == '' then return false end
  return s
end

-- Reads the record and the fence keeper in one call.
local function load(r, fk)
  local both = redis.call('MGET', r, fk)
  local raw, kept = both[1], both[2]
  if kept then kept = tonumber(kept) else kept = false end
  if not raw then return nil, kept end
  local ok, v = pcall(cmsgpack.unpack, raw)
  if not ok or type(v) ~= 'table' or (v[1] ~= 'i' and v[1] ~= 'c' and v[1] ~= 'r') then
    return redis.error_reply('DGCORRUPT record ' .. r .. ' cannot be read')
  end
  return {s = v[1], f = v[2], t = v[3], p = v[4], o = v[5], c = v[6], e = v[7], l = v[8],
          d = v[9], r = v[10]}, kept
end

local function put(r, fk, e)
  redis.call('SET', r, cmsgpack.pack({e.s, e.f, e.t, e.p, e.o, e.c, e.e, e.l, e.d, e.r}),
    'PXAT', n2s(e.e))
  redis.call('SET', fk, n2s(e.f), 'PXAT', n2s(e.e + fence_keep_ms))
end

local function copy(e)
  return {s = e.s, f = e.f, t = e.t, p = e.p, o = e.o, c = e.c, e = e.e, l = e.l, d = e.d, r = e.r}
end

-- Numbers go back as integer replies (exact: every time and fence is below 2^53).
local function record(tag, e)
  local state = 'in_progress'
  if e.s == 'c' then state = 'completed' end
  return {tag, state, e.f, e.p, e.o, e.c, e.e, e.l, e.d, e.r}
end

local function next_fence(cur, kept)
  local p = kept
  if cur and (not p or cur.f > p) then p = cur.f end
  local f = now * FENCE_PER_MS
  if p and p + 1 > f then f = p + 1 end
  return f
end

local function mismatch(stored, given)
  return stored and given and stored ~= given
end

local function lease_passed(e)
  return e.l and now >= e.l
end

local out = {}
local n = #KEYS / 2
for i = 0, n - 1 do
  local r, fk = KEYS[2 * i + 1], KEYS[2 * i + 2]
  local a = 2 + 6 * i
  local code = ARGV[a]
  local cur, kept = load(r, fk)
  if cur and cur.err then return cur end
  -- Present: stored and not expired (tombstones included). Live: present and not a tombstone.
  local present = nil
  if cur and now < cur.e then present = cur end
  local live = nil
  if present and present.s ~= 'r' then live = present end
  local reply

  if code == 'C' then
    local ttl_ms, lease_ms = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local fp, owner, token = opt(ARGV[a + 3]), opt(ARGV[a + 4]), ARGV[a + 5]
    local lease_exp = now + lease_ms
    local function take()
      local f = next_fence(cur, kept)
      local exp = math.max(now + ttl_ms, lease_exp)
      put(r, fk, {s = 'i', f = f, t = token, p = fp, o = owner, c = now, e = exp, l = lease_exp,
                  d = false, r = false})
      return {'N', token, f, lease_exp, exp}
    end
    if not live then
      reply = take()
    elseif mismatch(live.p, fp) then
      reply = {'E', 'fingerprint_mismatch'}
    elseif live.s == 'i' and owner and live.o == owner then
      local renewed = copy(live)
      renewed.l = lease_exp
      renewed.e = math.max(live.e, lease_exp)
      put(r, fk, renewed)
      reply = {'N', live.t, live.f, lease_exp, renewed.e}
    elseif live.s == 'i' and lease_passed(live) then
      reply = take()
    else
      reply = record('D', live)
    end

  elseif code == 'M' then
    local ttl_ms, fp, result = tonumber(ARGV[a + 1]), opt(ARGV[a + 2]), opt(ARGV[a + 3])
    local function set()
      local e = {s = 'c', f = next_fence(cur, kept), t = false, p = fp, o = false, c = now,
                 e = now + ttl_ms, l = false, d = now, r = result}
      put(r, fk, e)
      return record('M', e)
    end
    if not live then
      reply = set()
    elseif mismatch(live.p, fp) then
      reply = {'E', 'fingerprint_mismatch'}
    elseif live.s == 'i' and lease_passed(live) then
      reply = set()
    else
      reply = record('D', live)
    end

  elseif code == 'K' then
    local token, result, ttl = ARGV[a + 1], opt(ARGV[a + 2]), opt(ARGV[a + 3])
    if live and live.t == token then
      if live.s == 'i' then
        local done = copy(live)
        done.s = 'c'
        done.l = false
        done.d = now
        done.r = result
        if ttl then done.e = now + tonumber(ttl) end
        put(r, fk, done)
        reply = record('K', done)
      else
        -- A retried complete whose first answer was lost: answer it, change nothing.
        reply = record('K', live)
      end
    else
      reply = {'E', 'lease_lost'}
    end

  elseif code == 'R' then
    local token = ARGV[a + 1]
    if present and present.t == token then
      if present.s == 'i' then
        local tomb = copy(present)
        tomb.s = 'r'
        tomb.l = false
        tomb.r = false
        put(r, fk, tomb)
        reply = {'R'}
      elseif present.s == 'r' then
        reply = {'R'}
      else
        reply = {'E', 'lease_lost'}
      end
    else
      reply = {'E', 'lease_lost'}
    end

  elseif code == 'X' then
    local token, lease_ms = ARGV[a + 1], tonumber(ARGV[a + 2])
    if live and live.s == 'i' and live.t == token then
      local ext = copy(live)
      ext.l = now + lease_ms
      ext.e = math.max(live.e, ext.l)
      put(r, fk, ext)
      reply = {'X', ext.l}
    else
      reply = {'E', 'lease_lost'}
    end

  elseif code == 'G' then
    if live then reply = record('G', live) else reply = {'G'} end

  elseif code == 'F' then
    if live then
      -- Like a release, forgetting leaves a fence-keeping tombstone until the old expiry.
      local tomb = copy(live)
      tomb.s = 'r'
      tomb.t = false
      tomb.l = false
      tomb.r = false
      put(r, fk, tomb)
      reply = {'F', 1}
    else
      reply = {'F', 0}
    end

  else
    return redis.error_reply('DGPROTOCOL unknown op code ' .. tostring(code))
  end
  out[i + 1] = reply
end
return out

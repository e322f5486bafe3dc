-- dedupgate: dedupgate_core::decide, re-expressed for Redis. One call decides a run of
-- operations in order, each atomically (the whole script is one atomic step), on Redis's clock.
--
-- KEYS: one per op, the op's record key.
-- ARGV[1]: how long (ms) a record's key outlives the record's expiry (it keeps the fence).
-- ARGV[2 ..]: per op, its code and its arguments (the count depends on the code); '' stands
-- for "none" (every optional text field is non-empty when given: the Rust side validated the
-- op before sending it).
--   c ttl_ms lease_ms n new_token*n                  n claims without fingerprint or owner
--                                                    (on the next n keys)
--   C ttl_ms lease_ms fingerprint owner new_token    claim
--   M ttl_ms fingerprint result_json nonce           mark (nonce: fresh per call, kept as the
--                                                    record's token so a resend knows its own)
--   K token result_json ttl_ms                       complete
--   R token nonce                                    release (nonce: fresh per call, kept in the
--                                                    tombstone's result slot, which no answer shows)
--   X token lease_ms                                 extend
--   G                                                get
--   F                                                forget
--
-- A record is a MessagePack array {state, fence, token, fingerprint, owner, created_at_ms,
-- expires_at_ms, lease_expires_at_ms, completed_at_ms, result_json, ttl_ms} with `false` for
-- none, state 'i' (in_progress), 'c' (completed) or 'r' (released: a fence-keeping tombstone).
-- ttl_ms is the ttl a claim asked for (in_progress only): a complete that names no ttl keeps
-- the record until created_at_ms + ttl_ms (but at least min(ttl_ms, COMPLETE_GRACE_MS) past its
-- completion), not until the lease end that may have held the claim's expiry later. A record of 10 (written before ttl_ms
-- was kept) reads as ttl_ms false: its expiry stands.
-- Its key expires (PXAT) `keep` ms after the record's expires_at_ms, so Redis forgets it by
-- itself; until then the script treats it as absent but still reads its fence, so a fence
-- increases even if Redis's clock steps back after expiry.
--
-- A claim or mark first tries `SET key new_record NX GET`: when the key does not exist (the
-- common case) that one command is the whole decision, with fence now * 1000.
--
-- Reply: {now_ms, answer per op...}, an answer being
--   1                     new claim: token as sent, fence now*1000, lease now+lease_ms,
--                         expiry max(now+ttl_ms, lease end) (the key did not exist)
--   2                     new mark: fence now*1000, created = completed = now, expiry now+ttl_ms
--                         (the key did not exist)
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
local keep = tonumber(ARGV[1])
local FENCE_PER_MS = 1000
-- dedupgate_core::COMPLETE_GRACE_MS: a completed record outlives its completion by at least
-- min(claim ttl, this) when the complete names no ttl, so a retried complete is answered again.
local COMPLETE_GRACE_MS = 10000
local fresh_fence = now * FENCE_PER_MS
local call, pack, unpack = redis.call, cmsgpack.pack, cmsgpack.unpack

-- A new plain claim's record is this head, the 32-character token, and a tail that depends
-- only on the run's ttl and lease: no table and no MessagePack call per key.
local TOKEN_LEN = 32
-- (0x9b: an array of 11; 0xd9 0x20: a 32-byte string, valid MessagePack whatever header
-- cmsgpack itself would pick.)
local head = string.char(0x9b) .. pack('i', fresh_fence) .. string.char(0xd9, TOKEN_LEN)

local function decode(r, raw)
  local ok, v = pcall(unpack, raw)
  if not ok or type(v) ~= 'table' or (v[1] ~= 'i' and v[1] ~= 'c' and v[1] ~= 'r') then
    return nil
  end
  return {s = v[1], f = v[2], t = v[3], p = v[4], o = v[5], c = v[6], e = v[7], l = v[8],
          d = v[9], r = v[10], x = v[11] or false}
end

local function corrupt(r)
  return redis.error_reply('DGCORRUPT record ' .. r .. ' cannot be read')
end

local function enc(e)
  return pack({e.s, e.f, e.t, e.p, e.o, e.c, e.e, e.l, e.d, e.r, e.x})
end

local function put(r, e)
  call('SET', r, enc(e), 'PXAT', e.e + keep)
end

local function copy(e)
  return {s = e.s, f = e.f, t = e.t, p = e.p, o = e.o, c = e.c, e = e.e, l = e.l, d = e.d, r = e.r,
          x = e.x}
end

-- Numbers go back as integer replies (exact: every time and fence is below 2^53).
local function record(tag, e)
  local state = 'in_progress'
  if e.s == 'c' then state = 'completed' end
  return {tag, state, e.f, e.p, e.o, e.c, e.e, e.l, e.d, e.r}
end

local function next_fence(cur)
  local f = fresh_fence
  if cur and cur.f + 1 > f then f = cur.f + 1 end
  return f
end

local function mismatch(stored, given)
  return stored and given and stored ~= given
end

local function lease_passed(e)
  return e.l and now >= e.l
end

-- Present: stored and not expired (tombstones included). Live: present and not a tombstone.
local function states(cur)
  local present, live = nil, nil
  if cur and now < cur.e then present = cur end
  if present and present.s ~= 'r' then live = present end
  return present, live
end

-- A claim on a key that exists (cur: its record, maybe expired).
local function claim(r, cur, exp, lease_exp, fp, owner, token, ttl_ms)
  local _, live = states(cur)
  local function take()
    local f = next_fence(cur)
    put(r, {s = 'i', f = f, t = token, p = fp, o = owner, c = now, e = exp, l = lease_exp,
            d = false, r = false, x = ttl_ms})
    return {'N', token, f, lease_exp, exp}
  end
  if not live then
    return take()
  elseif mismatch(live.p, fp) then
    return {'E', 'fingerprint_mismatch'}
  elseif live.s == 'i' and (live.t == token or (owner and live.o == owner)) then
    -- The same owner claiming again, or this very call run a second time (its token is fresh
    -- per call, so only a resend of the call can find it): the claim is the caller's own.
    -- The renewal never shortens the lease it renews.
    local renewed = copy(live)
    renewed.l = math.max(live.l or lease_exp, lease_exp)
    renewed.e = math.max(live.e, renewed.l)
    put(r, renewed)
    return {'N', live.t, live.f, renewed.l, renewed.e}
  elseif live.s == 'i' and lease_passed(live) then
    return take()
  else
    return record('D', live)
  end
end

local out = {now}
local a = 2
local i = 1
local nkeys = #KEYS
while i <= nkeys do
  local r = KEYS[i]
  local code = ARGV[a]
  local reply

  if code == 'c' then
    -- A run of plain claims sharing ttl and lease: the hot path, one command per new key.
    local ttl_ms = tonumber(ARGV[a + 1])
    local lease_exp = now + tonumber(ARGV[a + 2])
    local exp = now + ttl_ms
    if lease_exp > exp then exp = lease_exp end
    local n = tonumber(ARGV[a + 3])
    a = a + 4
    local tail = pack(false, false, now, exp, lease_exp, false, false, ttl_ms)
    local pxat = string.format('%.0f', exp + keep)
    for j = i, i + n - 1 do
      local key, token = KEYS[j], ARGV[a]
      a = a + 1
      local v
      if #token == TOKEN_LEN then
        v = head .. token .. tail
      else
        v = enc({s = 'i', f = fresh_fence, t = token, p = false, o = false, c = now, e = exp,
                 l = lease_exp, d = false, r = false, x = ttl_ms})
      end
      local old = call('SET', key, v, 'NX', 'GET', 'PXAT', pxat)
      if not old then
        out[j + 1] = 1
      else
        local cur = decode(key, old)
        if not cur then return corrupt(key) end
        out[j + 1] = claim(key, cur, exp, lease_exp, false, false, token, ttl_ms)
      end
    end
    i = i + n - 1
    reply = out[i + 1]

  elseif code == 'C' then
    local ttl_ms, lease_ms = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local fp, owner, token = ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
    a = a + 6
    if fp == '' then fp = false end
    if owner == '' then owner = false end
    local lease_exp = now + lease_ms
    local exp = math.max(now + ttl_ms, lease_exp)
    local v = enc({s = 'i', f = fresh_fence, t = token, p = fp, o = owner, c = now, e = exp,
                   l = lease_exp, d = false, r = false, x = ttl_ms})
    local old = call('SET', r, v, 'NX', 'GET', 'PXAT', exp + keep)
    if not old then
      reply = 1
    else
      local cur = decode(r, old)
      if not cur then return corrupt(r) end
      reply = claim(r, cur, exp, lease_exp, fp, owner, token, ttl_ms)
    end

  elseif code == 'M' then
    local ttl_ms, fp, result, nonce = tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
    a = a + 5
    if fp == '' then fp = false end
    if result == '' then result = false end
    if nonce == '' then nonce = false end
    local function new(f)
      return {s = 'c', f = f, t = nonce, p = fp, o = false, c = now, e = now + ttl_ms, l = false,
              d = now, r = result, x = false}
    end
    local old = call('SET', r, enc(new(fresh_fence)), 'NX', 'GET', 'PXAT', now + ttl_ms + keep)
    if not old then
      reply = 2
    else
      local cur = decode(r, old)
      if not cur then return corrupt(r) end
      local _, live = states(cur)
      local function set()
        local e = new(next_fence(cur))
        put(r, e)
        return record('M', e)
      end
      if not live then
        reply = set()
      elseif nonce and live.s == 'c' and live.t == nonce then
        reply = record('M', live) -- this very call run a second time: its own mark
      elseif mismatch(live.p, fp) then
        reply = {'E', 'fingerprint_mismatch'}
      elseif live.s == 'i' and lease_passed(live) then
        reply = set()
      else
        reply = record('D', live)
      end
    end

  else
    local raw = call('GET', r)
    local cur = nil
    if raw then
      cur = decode(r, raw)
      if not cur then return corrupt(r) end
    end
    local present, live = states(cur)

    if code == 'K' then
      local token, result, ttl = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
      a = a + 4
      if result == '' then result = false end
      if live and live.t == token then
        if live.s == 'i' then
          local done = copy(live)
          done.s = 'c'
          done.l = false
          done.d = now
          done.r = result
          done.x = false
          if ttl ~= '' then
            done.e = now + tonumber(ttl)
          elseif live.x then
            done.e = math.max(live.c + live.x, now + math.min(live.x, COMPLETE_GRACE_MS))
          end
          put(r, done)
          reply = record('K', done)
        else
          -- A retried complete whose first answer was lost: answer it, change nothing.
          reply = record('K', live)
        end
      else
        reply = {'E', 'lease_lost'}
      end

    elseif code == 'R' then
      local token, nonce = ARGV[a + 1], ARGV[a + 2]
      a = a + 3
      if nonce == '' then nonce = false end
      if present and present.t == token and present.s == 'i' then
        local tomb = copy(present)
        tomb.s = 'r'
        tomb.l = false
        tomb.r = nonce
        tomb.x = false -- ttl_ms is for in_progress records only
        put(r, tomb)
        reply = {'R'}
      elseif nonce and present and present.s == 'r' and present.t == token and present.r == nonce then
        reply = {'R'} -- this very call run a second time: its own release
      else
        -- Released or completed already, taken over, expired or never issued: not the holder.
        reply = {'E', 'lease_lost'}
      end

    elseif code == 'X' then
      local token, lease_ms = ARGV[a + 1], tonumber(ARGV[a + 2])
      a = a + 3
      if live and live.s == 'i' and live.t == token then
        local ext = copy(live)
        ext.l = now + lease_ms
        ext.e = math.max(live.e, ext.l)
        put(r, ext)
        reply = {'X', ext.l}
      else
        reply = {'E', 'lease_lost'}
      end

    elseif code == 'G' then
      a = a + 1
      if live then reply = record('G', live) else reply = {'G'} end

    elseif code == 'F' then
      a = a + 1
      if live then
        -- Like a release, forgetting leaves a fence-keeping tombstone until the old expiry.
        local tomb = copy(live)
        tomb.s = 'r'
        tomb.t = false
        tomb.l = false
        tomb.r = false
        tomb.x = false
        put(r, tomb)
        reply = {'F', 1}
      else
        reply = {'F', 0}
      end

    else
      return redis.error_reply('DGPROTOCOL unknown op code ' .. tostring(code))
    end
  end
  out[i + 1] = reply
  i = i + 1
end
return out

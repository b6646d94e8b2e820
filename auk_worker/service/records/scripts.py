"""Every Lua script the service runs in Redis, each with what it is handed (``KEYS``, ``ARGV``) and what it returns.

A script is atomic against every other client, which is what makes each state transition safe against the API (a
cancel), other workers (a redelivered task) and the reaper. They are kept together so that a reader sees every
write that moves a record in one place; the Python that runs each one names it (``scripts.START``...).

The job records' scripts share ``HELPERS`` (``holder_state``, ``move_status``, ``move_batch``); the key layout they
write is the one ``records/jobs.py`` lists.
"""

# ------------------------------------------------------------------------------------------------ job records

# Shared Lua: move a job between its owner's status indexes (move_status); move its batch counters from one status
# to another and claim the manifest when the batch's terminal count reaches its total (move_batch: returns 1 when
# this call claimed it).
HELPERS = """
local function is_terminal(s)
  return s == 'succeeded' or s == 'failed' or s == 'canceled'
end
-- A running record's holder ("<worker id>/<instance id>"): 'dead' when its worker's heartbeat is gone, names
-- another instance or says failed; 'holds' when that heartbeat lists the job or was written before the holder
-- took it (it may not show the job yet); else 'let go' (alive, but its attempt ended without a transition).
local function holder_state(ns, holder, job_id, held_at)
  local cut = string.find(holder or '', '/[^/]*$')
  if not cut then return 'dead' end
  local beat_key = ns .. ':worker:' .. string.sub(holder, 1, cut - 1)
  local beat = redis.call('HMGET', beat_key, 'instance', 'state', 'job_id', 'ts')
  if beat[1] ~= string.sub(holder, cut + 1) or beat[2] == 'failed' then return 'dead' end
  if (tonumber(beat[4]) or 0) <= (tonumber(held_at) or 0) then return 'holds' end
  if string.find(',' .. (beat[3] or '') .. ',', ',' .. job_id .. ',', 1, true) then return 'holds' end
  return 'let go'
end
local function move_status(job, ns, old, new)
  if old == new then return end
  local id = redis.call('HGET', job, 'id')
  local owner_index = ns .. ':owner:' .. redis.call('HGET', job, 'owner')
  local score = redis.call('ZSCORE', owner_index .. ':jobs', id)
  redis.call('ZREM', owner_index .. ':status:' .. old, id)
  if score then redis.call('ZADD', owner_index .. ':status:' .. new, score, id) end
end
local function move_batch(job, ns, old, new, claim)
  local batch = redis.call('HGET', job, 'batch_id')
  if (not batch) or batch == '' or old == new then return 0 end
  local bkey = ns .. ':batch:' .. batch
  redis.call('HINCRBY', bkey, 'n_' .. old, -1)
  redis.call('HINCRBY', bkey, 'n_' .. new, 1)
  if is_terminal(new) and not is_terminal(old) then
    local done = redis.call('HINCRBY', bkey, 'terminal', 1)
    local total = tonumber(redis.call('HGET', bkey, 'total'))
    if claim and done >= total then
      return redis.call('HSETNX', bkey, 'manifest_claimed', '1')
    end
  end
  return 0
end
"""

# KEYS: job, owner index, idempotency key ('' for none), the owner's index of the record's status, the owner's
# status-indexed marker (set with an owner's first job: it has no older records to index).
# ARGV: job id, score, job key prefix, then field/value pairs.
CREATE = """
if KEYS[3] ~= '' then
  local existing = redis.call('GET', KEYS[3])
  if existing then
    local rec = redis.call('HGETALL', ARGV[3] .. existing)
    if #rec > 0 then return {0, rec} end
  end
end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
if redis.call('ZCARD', KEYS[2]) == 0 then redis.call('SET', KEYS[5], '1') end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
if KEYS[3] ~= '' then redis.call('SET', KEYS[3], ARGV[1]) end
return {1, redis.call('HGETALL', KEYS[1])}
"""

# KEYS: job. ARGV: namespace, now, holder, held_at, job id. Returns {} if missing, {'terminal'} if terminal,
# {'held'} if a live holder holds it, else the record.
START = (
    HELPERS
    + """
local job = KEYS[1]
local status = redis.call('HGET', job, 'status')
if not status then return {} end
if is_terminal(status) then return {'terminal'} end
if status == 'running' then
  local prev = redis.call('HGET', job, 'worker') or ''
  if prev ~= '' and prev ~= ARGV[3] then
    local state = holder_state(ARGV[1], prev, ARGV[5], redis.call('HGET', job, 'held_at'))
    if state == 'holds' then return {'held'} end
    if state == 'dead' then redis.call('HINCRBY', job, 'kills', 1) end
  end
end
redis.call('HINCRBY', job, 'attempts', 1)
redis.call('HSET', job, 'status', 'running', 'worker', ARGV[3], 'held_at', ARGV[4], 'progress', '')
redis.call('HDEL', job, 'delivered')
redis.call('SREM', ARGV[1] .. ':delivered', job)
redis.call('SADD', ARGV[1] .. ':running', job)
local started = redis.call('HGET', job, 'started_at')
if (not started) or started == '' then redis.call('HSET', job, 'started_at', ARGV[2]) end
move_status(job, ARGV[1], status, 'running')
move_batch(job, ARGV[1], status, 'running', false)
return redis.call('HGETALL', job)
"""
)

# KEYS: job. ARGV: namespace, new status, now, claim ('1'/'0'), allowed-from list (comma), holder ('' for any),
# field/value pairs. Returns {0} when the transition does not apply (with a holder: unless that holder holds the
# running record), else {claimed, record}.
TRANSITION = (
    HELPERS
    + """
local job = KEYS[1]
local status = redis.call('HGET', job, 'status')
if not status then return {0} end
if is_terminal(status) then return {0} end
if not string.find(',' .. ARGV[5] .. ',', ',' .. status .. ',', 1, true) then return {0} end
if ARGV[6] ~= '' and (status ~= 'running' or redis.call('HGET', job, 'worker') ~= ARGV[6]) then return {0} end
if #ARGV > 6 then
  local fields = {}
  for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('HSET', job, unpack(fields))
end
redis.call('HSET', job, 'status', ARGV[2])
if status == 'running' and ARGV[2] ~= 'running' then redis.call('SREM', ARGV[1] .. ':running', job) end
if is_terminal(ARGV[2]) then redis.call('HSET', job, 'finished_at', ARGV[3]) end
move_status(job, ARGV[1], status, ARGV[2])
local claimed = move_batch(job, ARGV[1], status, ARGV[2], ARGV[4] == '1')
return {claimed, redis.call('HGETALL', job)}
"""
)

# KEYS: job. ARGV: step, total, holder ('' for any). Writes progress only while running (under that holder);
# returns the status, or 'lost' when another holder runs it.
PROGRESS = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'running' then
  if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'worker') ~= ARGV[3] then return 'lost' end
  redis.call('HSET', KEYS[1], 'progress', '{"step":' .. ARGV[1] .. ',"total":' .. ARGV[2] .. '}')
end
return status
"""

# KEYS: job, stats ('' to count nothing). ARGV: namespace, terminal status, TTL in seconds (0: keep forever).
# Counts the finished job and starts the clocks of its record, its idempotency key and (once its last job has
# ended) its batch, with the batch's idempotency key.
RETIRE = """
if KEYS[2] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[2], 1) end
local ttl = tonumber(ARGV[3])
if ttl <= 0 then return 0 end
redis.call('EXPIRE', KEYS[1], ttl)
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem and idem ~= '' then redis.call('EXPIRE', idem, ttl) end
local batch = redis.call('HGET', KEYS[1], 'batch_id')
if batch and batch ~= '' then
  local bkey = ARGV[1] .. ':batch:' .. batch
  local counts = redis.call('HMGET', bkey, 'terminal', 'total')
  if counts[1] and tonumber(counts[1]) >= tonumber(counts[2]) then
    redis.call('EXPIRE', bkey, ttl)
    redis.call('EXPIRE', bkey .. ':jobs', ttl)
    local bidem = redis.call('HGET', bkey, 'idem')
    if bidem and bidem ~= '' then redis.call('EXPIRE', bidem, ttl) end
  end
end
return 1
"""


# -------------------------------------------------------------------------------- the reaper's (worker/recovery.py)

# KEYS: a lock. ARGV: its owner's token. Deletes the lock only if that owner still has it (it may have expired and
# been taken by another): the reaper's and the fair-share feeder's locks.
UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: the running set. ARGV: namespace. Returns {job id, queue, holder, state} for every running record whose
# holder is dead or let go of it; drops finished records left in the set.
ORPHANS = (
    HELPERS
    + """
local prefix = ARGV[1] .. ':job:'
local out = {}
for _, job in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local rec = redis.call('HMGET', job, 'status', 'worker', 'held_at', 'queue')
  if rec[1] ~= 'running' then
    redis.call('SREM', KEYS[1], job)
  else
    local id = string.sub(job, #prefix + 1)
    local state = holder_state(ARGV[1], rec[2], id, rec[3])
    if state ~= 'holds' then
      out[#out + 1] = {id, rec[4] or '', rec[2] or '', state}
    end
  end
end
-- Received but never started: only a dead receiver makes an orphan (a live one may hold it for a retry's ETA).
local delivered = ARGV[1] .. ':delivered'
for _, job in ipairs(redis.call('SMEMBERS', delivered)) do
  local rec = redis.call('HMGET', job, 'status', 'delivered', 'queue')
  if rec[1] ~= 'queued' or (not rec[2]) or rec[2] == '' then
    redis.call('SREM', delivered, job)
  else
    local id = string.sub(job, #prefix + 1)
    if holder_state(ARGV[1], rec[2], id, nil) == 'dead' then
      out[#out + 1] = {id, rec[3] or '', rec[2], 'unstarted'}
    end
  end
end
return out
"""
)

# KEYS: job keys. ARGV: namespace, holder. Marks each queued one as received by that holder.
MARK_DELIVERED = """
for _, job in ipairs(KEYS) do
  if redis.call('HGET', job, 'status') == 'queued' then
    redis.call('HSET', job, 'delivered', ARGV[2])
    redis.call('SADD', ARGV[1] .. ':delivered', job)
  end
end
return 1
"""

# KEYS: job. ARGV: namespace, holder. Forgets a delivery to that (dead) holder of a still queued record; 1 if it did.
FORGET_DELIVERY = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' or redis.call('HGET', KEYS[1], 'delivered') ~= ARGV[2] then
  return 0
end
redis.call('HDEL', KEYS[1], 'delivered')
redis.call('SREM', ARGV[1] .. ':delivered', KEYS[1])
return 1
"""

# KEYS: job. ARGV: namespace, holder, job id. running -> queued when that holder still has it and no longer holds
# it (kills + 1 when it is dead). Returns {} when nothing changed, else {kills}.
RELEASE_ORPHAN = (
    HELPERS
    + """
local job = KEYS[1]
local status = redis.call('HGET', job, 'status')
if status ~= 'running' or redis.call('HGET', job, 'worker') ~= ARGV[2] then return {} end
local state = holder_state(ARGV[1], ARGV[2], ARGV[3], redis.call('HGET', job, 'held_at'))
if state == 'holds' then return {} end
if state == 'dead' then redis.call('HINCRBY', job, 'kills', 1) end
redis.call('HSET', job, 'status', 'queued', 'worker', '', 'progress', '')
redis.call('SREM', ARGV[1] .. ':running', job)
move_status(job, ARGV[1], 'running', 'queued')
move_batch(job, ARGV[1], 'running', 'queued', false)
return {tonumber(redis.call('HGET', job, 'kills'))}
"""
)


# ------------------------------------------------------------------------------ webhooks (delivery/webhooks/store.py)

# KEYS: secret hash. ARGV: new secret, now, grace seconds. The old current secret keeps signing until now + grace.
WEBHOOK_ROTATE = """
local old = redis.call('HGET', KEYS[1], 'current')
if old then redis.call('HSET', KEYS[1], 'previous', old, 'previous_until', tonumber(ARGV[2]) + tonumber(ARGV[3])) end
redis.call('HSET', KEYS[1], 'current', ARGV[1])
return ARGV[1]
"""


_REDIS_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n"

# KEYS: delivery hash, due zset. ARGV: id, then field/value pairs. Returns 0 when the id exists already.
WEBHOOK_ENQUEUE = _REDIS_NOW + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local fields = {}
for i = 2, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], 'created_at', now, 'next_attempt_at', now, unpack(fields))
redis.call('ZADD', KEYS[2], now, ARGV[1])
return 1
"""

# KEYS: due zset. ARGV: hash key prefix, lease seconds, lease token. Claims the earliest due delivery: its due time
# moves to the lease's end, its attempt is counted. Returns {} or the delivery's fields.
WEBHOOK_CLAIM = _REDIS_NOW + """
while true do
  local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1)
  if #due == 0 then return {} end
  local key = ARGV[1] .. due[1]
  if redis.call('HGET', key, 'state') == 'pending' then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), due[1])
    redis.call('HINCRBY', key, 'attempts', 1)
    redis.call('HSET', key, 'lease', ARGV[3], 'last_attempt_at', now)
    return redis.call('HGETALL', key)
  end
  redis.call('ZREM', KEYS[1], due[1])
end
"""

# KEYS: delivery hash, due zset. ARGV: id, lease token, outcome (delivered|failed|retry), delay, status, error.
# Only the lease holder writes; returns 0 to anyone else.
WEBHOOK_FINISH = _REDIS_NOW + """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'lease', '', 'last_status', ARGV[5], 'last_error', ARGV[6])
if ARGV[3] == 'retry' then
  local at = now + tonumber(ARGV[4])
  redis.call('HSET', KEYS[1], 'next_attempt_at', at)
  redis.call('ZADD', KEYS[2], at, ARGV[1])
else
  redis.call('HSET', KEYS[1], 'state', ARGV[3], 'next_attempt_at', '', ARGV[3] .. '_at', now)
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return 1
"""


# -------------------------------------------------------------------------------- fair share (queues/fairshare.py)

# KEYS: ring, the key's staged list, the set of staged queues. ARGV: owner, queue, items...
FAIR_STAGE = """
local before = redis.call('LLEN', KEYS[2])
redis.call('RPUSH', KEYS[2], unpack(ARGV, 3))
if before == 0 then redis.call('RPUSH', KEYS[1], ARGV[1]) end
redis.call('SADD', KEYS[3], ARGV[2])
return before
"""

# KEYS: ring, inflight hash. ARGV: staged-list prefix, count, now. Returns the released items, round-robin by key.
FAIR_RELEASE = """
local out = {}
for i = 1, tonumber(ARGV[2]) do
  local owner = redis.call('LPOP', KEYS[1])
  if not owner then break end
  local staged = ARGV[1] .. owner
  local item = redis.call('LPOP', staged)
  if item then
    out[#out + 1] = item
    redis.call('HSET', KEYS[2], item, ARGV[3])
  end
  if redis.call('LLEN', staged) > 0 then redis.call('RPUSH', KEYS[1], owner) end
end
return out
"""


# ------------------------------------------------------------------------------- the API's rate limit (api/quotas.py)

# KEYS: the key's bucket. ARGV: rate (tokens per second), burst. Returns the seconds to wait, "0" when admitted.
RATE_TAKE = """
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return tostring(wait)
"""


# What a bulk feed has to do, in one command (a feeder wakes every FEED_INTERVAL_S in every process): the staged
# queues whose Celery queue has room, and whether anything waits in the in-flight hash. KEYS: the set of staged
# queues, the in-flight hash. ARGV: the ring prefix, the depth. A queue with nothing staged leaves the set (staging
# adds it back).
FAIR_PLAN = """
local out = {redis.call('HLEN', KEYS[2])}
for _, queue in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('LLEN', ARGV[1] .. queue .. ':ring') == 0 then
    redis.call('SREM', KEYS[1], queue)
  elseif redis.call('LLEN', queue) < tonumber(ARGV[2]) then
    out[#out + 1] = queue
  end
end
return out
"""

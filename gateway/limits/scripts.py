"""The Lua scripts the limiter runs in Redis, and the numbers they share: each runs atomically, so the counts are
exact across processes and hosts.
"""

from __future__ import annotations

# In-flight marks older than this are taken for requests whose process died before removing them.
STALE_IN_FLIGHT_S = 3600

# The counters the scripts are given, as KEYS: a key's requests this minute (1), tokens this minute (2),
# today (3) and this month (4), its in-flight set (5); for a key of a team, also the team's requests this
# minute (6), tokens this minute (7), today (8), this month (9), and money this month in micro-units (10).
# A limit's number in a refusal is its counter's number here (WHAT, TEAM_WHAT).

# Admits the requests of one key that came in one turn of a gateway's event loop, in order.
# ARGV: how many KEYS (5, or 10 with a team), each counter's limit (0: none; the 5th is the in-flight
# limit), now, STALE_IN_FLIGHT_S, then each request's id. Answers 1 + KEYS numbers a request: which
# limit refused it (0: none), then each counter (the 5th: the requests in flight).
ADMIT = """
local n = tonumber(ARGV[1])
local used = {}
for i = 1, n do
  if i ~= 5 then used[i] = tonumber(redis.call('GET', KEYS[i]) or '0') end
end
local now = tonumber(ARGV[n + 2])
local stale = tonumber(ARGV[n + 3])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now - stale)
used[5] = redis.call('ZCARD', KEYS[5])
local answers, marks, admitted = {}, {}, 0
for r = n + 4, #ARGV do
  local which = 0
  for i = 1, n do
    local limit = tonumber(ARGV[i + 1])
    if limit > 0 and used[i] >= limit then which = i break end
  end
  if which == 0 then
    admitted = admitted + 1
    used[1] = used[1] + 1
    used[5] = used[5] + 1
    if n > 5 then used[6] = used[6] + 1 end
    marks[#marks + 1] = now
    marks[#marks + 1] = ARGV[r]
  end
  local a = #answers
  answers[a + 1] = which
  for i = 1, n do answers[a + 1 + i] = used[i] end
end
if admitted > 0 then
  if redis.call('INCRBY', KEYS[1], admitted) == admitted then redis.call('EXPIRE', KEYS[1], 120) end
  if n > 5 and redis.call('INCRBY', KEYS[6], admitted) == admitted then redis.call('EXPIRE', KEYS[6], 120) end
  redis.call('ZADD', KEYS[5], unpack(marks))
  redis.call('EXPIRE', KEYS[5], stale)
end
return answers
"""

# Which window each counter of tokens or money is (1: minute, 2: day, 3: month), for its expiry.
WINDOW_OF = "local window = {[2] = 1, [3] = 2, [4] = 3, [7] = 1, [8] = 2, [9] = 3, [10] = 3}"

# After the answers of one key. KEYS: as ADMIT's. ARGV: the answers' tokens together less what they
# had reserved (below 0 when they reserved more), their money likewise, each window's expiry (set when
# its counter is made), then each request's id.
SETTLE = (
    WINDOW_OF
    + """
local deltas = {tonumber(ARGV[1]), tonumber(ARGV[2])}
for _, i in ipairs({2, 3, 4, 7, 8, 9, 10}) do
  local delta = deltas[i == 10 and 2 or 1]
  if i <= #KEYS and delta ~= 0 then
    local expiry = tonumber(ARGV[2 + window[i]])
    if redis.call('INCRBY', KEYS[i], delta) == delta then redis.call('EXPIRE', KEYS[i], expiry) end
  end
end
return redis.call('ZREM', KEYS[5], unpack(ARGV, 6))
"""
)

# Reserves the most each request of one key may cost in its windows of tokens (and its team's money),
# in the order they came. KEYS: as ADMIT's. ARGV: how many KEYS, each counter's limit as ADMIT has them,
# each window's expiry, then each request's id, tokens and money. Answers 1 + KEYS numbers a request:
# which counter refused it (0: none; -1: it is not in flight, so ADMIT refused it and nothing is held),
# then each counter, with what is reserved. The check on the flight is what lets a small request's
# RESERVE go in the same batch as its ADMIT, before ADMIT has answered: one round trip, not two.
RESERVE = (
    WINDOW_OF
    + """
local n = tonumber(ARGV[1])
local counters = {2, 3, 4}
if n > 5 then counters = {2, 3, 4, 7, 8, 9, 10} end
local used = {}
for i = 1, n do used[i] = 0 end
for _, i in ipairs(counters) do used[i] = tonumber(redis.call('GET', KEYS[i]) or '0') end
local added = {}
for _, i in ipairs(counters) do added[i] = 0 end
local answers = {}
for r = n + 5, #ARGV, 3 do
  local amount = {tonumber(ARGV[r + 1]), tonumber(ARGV[r + 2])}
  local which = 0
  if not redis.call('ZSCORE', KEYS[5], ARGV[r]) then which = -1 end
  for _, i in ipairs(counters) do
    if which ~= 0 then break end
    local limit = tonumber(ARGV[i + 1])
    if limit > 0 and used[i] + amount[i == 10 and 2 or 1] > limit then which = i break end
  end
  if which == 0 then
    for _, i in ipairs(counters) do
      local want = amount[i == 10 and 2 or 1]
      used[i] = used[i] + want
      added[i] = added[i] + want
    end
  end
  local a = #answers
  answers[a + 1] = which
  for i = 1, n do answers[a + 1 + i] = used[i] end
end
for _, i in ipairs(counters) do
  if added[i] > 0 and redis.call('INCRBY', KEYS[i], added[i]) == added[i] then
    redis.call('EXPIRE', KEYS[i], tonumber(ARGV[n + 1 + window[i]]))
  end
end
return answers
"""
)

# Each window's counter outlives its window a little, then goes.
EXPIRES = {"minute": 120, "day": 2 * 86400, "month": 33 * 86400}

# Requests (or flights) one script is given at most: Lua's unpack() stops at a few thousand.
BATCH = 200

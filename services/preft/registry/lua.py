"""Lua scripts that make each multi-key registry change one atomic step in Redis.

Key names are built inside the scripts from tenant and adapter names, which `preft.common.refs` restricts to
[a-z0-9._-], so this needs a single Redis (or one hash slot), not a cluster. Scripts answer a list whose first
item is "ok" or an error word the index turns into a domain error.
"""

CREATE_TENANT = """
local tk = 'preft:tenant:' .. ARGV[1]
if redis.call('EXISTS', tk) == 1 then return {'exists'} end
redis.call('HSET', tk, 'created_unix_ms', ARGV[2], 'disabled', '0', 'adapter_count', 0, 'bytes_used', 0,
  'requests_per_min', ARGV[3], 'tokens_per_min', ARGV[4], 'max_adapters', ARGV[5], 'max_bytes', ARGV[6],
  'tokens_per_month', ARGV[7])
redis.call('SADD', 'preft:tenants', ARGV[1])
return {'ok'}
"""

UPDATE_TENANT = """
local tk = 'preft:tenant:' .. ARGV[1]
if redis.call('EXISTS', tk) == 0 then return {'no_tenant'} end
for i = 2, #ARGV, 2 do redis.call('HSET', tk, ARGV[i], ARGV[i + 1]) end
return {'ok'}
"""

ISSUE_KEY = """
local tk = 'preft:tenant:' .. ARGV[1]
if redis.call('EXISTS', tk) == 0 then return {'no_tenant'} end
if redis.call('HGET', tk, 'disabled') == '1' then return {'disabled'} end
redis.call('HSET', 'preft:keyid:' .. ARGV[2], 'tenant', ARGV[1], 'hash', ARGV[3], 'label', ARGV[4],
  'created_unix_ms', ARGV[5], 'expires_unix_ms', ARGV[6], 'revoked_unix_ms', 0)
redis.call('SET', 'preft:key:' .. ARGV[3], ARGV[2])
redis.call('SADD', tk .. ':keys', ARGV[2])
redis.call('SADD', 'preft:keys', ARGV[2])
return {'ok'}
"""

REVOKE_KEY = """
local kk = 'preft:keyid:' .. ARGV[1]
if redis.call('EXISTS', kk) == 0 then return {'no_key'} end
if redis.call('HGET', kk, 'revoked_unix_ms') == '0' then
  redis.call('HSET', kk, 'revoked_unix_ms', ARGV[2])
  redis.call('DEL', 'preft:key:' .. redis.call('HGET', kk, 'hash'))
end
return {'ok'}
"""

PUBLISH = """
local t, n, manifest, size, alias, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
local tk = 'preft:tenant:' .. t
if redis.call('EXISTS', tk) == 0 then return {'no_tenant'} end
if redis.call('HGET', tk, 'disabled') == '1' then return {'disabled'} end
for i = 7, #ARGV do
  if redis.call('SISMEMBER', 'preft:gc:deleting', ARGV[i]) == 1 then return {'blob_gone', ARGV[i]} end
end
local ak = 'preft:adapter:' .. t .. '/' .. n
local is_new = redis.call('EXISTS', ak) == 0
local count = tonumber(redis.call('HGET', tk, 'adapter_count'))
local max_adapters = tonumber(redis.call('HGET', tk, 'max_adapters'))
if is_new and count >= max_adapters then return {'max_adapters', tostring(max_adapters)} end
local used, max_bytes = tonumber(redis.call('HGET', tk, 'bytes_used')), tonumber(redis.call('HGET', tk, 'max_bytes'))
if used + size > max_bytes then return {'max_bytes', tostring(used), tostring(max_bytes)} end
local v = redis.call('INCR', ak .. ':seq')
redis.call('HSETNX', ak, 'created_unix_ms', now)
redis.call('HSET', ak .. ':versions', v, manifest)
redis.call('HSET', ak .. ':aliases', 'latest', v)
if alias ~= '' then redis.call('HSET', ak .. ':aliases', alias, v) end
if is_new then
  redis.call('SADD', tk .. ':adapters', n)
  redis.call('SADD', 'preft:adapters', t .. '/' .. n)
  redis.call('HINCRBY', tk, 'adapter_count', 1)
end
redis.call('HINCRBY', tk, 'bytes_used', size)
for i = 7, #ARGV do
  redis.call('HINCRBY', 'preft:blobrefs', ARGV[i], 1)
  redis.call('ZADD', 'preft:blobtouch', now, ARGV[i])
end
return {'ok', tostring(v)}
"""

RESOLVE = """
local caller, owner, n, ver, alias = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local ak = 'preft:adapter:' .. owner .. '/' .. n
if redis.call('EXISTS', ak) == 0 then return {'not_found'} end
if caller ~= '' and caller ~= owner and redis.call('SISMEMBER', ak .. ':shared', caller) == 0 then
  return {'not_found'}
end
if redis.call('HGET', 'preft:tenant:' .. owner, 'disabled') == '1' then return {'disabled'} end
if ver == '' then
  ver = redis.call('HGET', ak .. ':aliases', alias)
  if not ver then return {'no_alias'} end
end
local m = redis.call('HGET', ak .. ':versions', ver)
if not m then return {'no_version'} end
return {'ok', ver, m}
"""

SET_ALIAS = """
local ak = 'preft:adapter:' .. ARGV[1] .. '/' .. ARGV[2]
if redis.call('EXISTS', ak) == 0 then return {'not_found'} end
if ARGV[4] == '0' then
  if redis.call('HDEL', ak .. ':aliases', ARGV[3]) == 0 then return {'no_alias'} end
  return {'ok'}
end
if redis.call('HEXISTS', ak .. ':versions', ARGV[4]) == 0 then return {'no_version'} end
redis.call('HSET', ak .. ':aliases', ARGV[3], ARGV[4])
return {'ok'}
"""

# ARGV: owner, name, mode ('direct' = an operator's share, 'offer' = a tenant's), the most pending offers, the
# count of tenants to add, then the tenants to add and those to remove. An offer names tenants that need not
# exist and does the same work either way (a tenant's answer must not tell); an offer to a name no tenant has yet
# waits under it. An accepted share is `:shared` + `shared_in`; a pending offer `:offered` + `offers_in`.
SHARE = """
local t, n, mode, max_offers, nadd = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local member = t .. '/' .. n
local ak = 'preft:adapter:' .. member
if redis.call('EXISTS', ak) == 0 then return {'not_found'} end
if mode == 'direct' then
  for i = 6, #ARGV do
    if redis.call('EXISTS', 'preft:tenant:' .. ARGV[i]) == 0 then return {'no_tenant', ARGV[i]} end
  end
else
  local pending = redis.call('SCARD', ak .. ':offered')
  for i = 6, 5 + nadd do
    local known = redis.call('SISMEMBER', ak .. ':offered', ARGV[i]) + redis.call('SISMEMBER', ak .. ':shared', ARGV[i])
    if known == 0 then pending = pending + 1 end
  end
  for i = 6 + nadd, #ARGV do pending = pending - redis.call('SISMEMBER', ak .. ':offered', ARGV[i]) end
  if pending > max_offers then return {'too_many_offers'} end
end
for i = 6, #ARGV do
  local r = 'preft:tenant:' .. ARGV[i]
  if i >= 6 + nadd or mode == 'direct' then
    redis.call('SREM', ak .. ':offered', ARGV[i])
    redis.call('SREM', r .. ':offers_in', member)
  end
  if i >= 6 + nadd then
    redis.call('SREM', ak .. ':shared', ARGV[i])
    redis.call('SREM', r .. ':shared_in', member)
  elseif mode == 'direct' then
    redis.call('SADD', ak .. ':shared', ARGV[i])
    redis.call('SADD', r .. ':shared_in', member)
  elseif redis.call('SISMEMBER', ak .. ':shared', ARGV[i]) == 0 then
    redis.call('SADD', ak .. ':offered', ARGV[i])
    redis.call('SADD', r .. ':offers_in', member)
  end
end
return {'ok'}
"""

# A recipient's answer. ARGV: recipient, owner, name, '1' to accept or '0' to decline (or leave an accepted share).
ANSWER_OFFER = """
local r, member, accept = ARGV[1], ARGV[2] .. '/' .. ARGV[3], ARGV[4] == '1'
local ak, rk = 'preft:adapter:' .. member, 'preft:tenant:' .. ARGV[1]
local offered = redis.call('SISMEMBER', rk .. ':offers_in', member) == 1
local shared = redis.call('SISMEMBER', rk .. ':shared_in', member) == 1
if not (offered or shared) or redis.call('EXISTS', ak) == 0 then return {'no_offer'} end
redis.call('SREM', rk .. ':offers_in', member)
redis.call('SREM', ak .. ':offered', r)
if accept then
  redis.call('SADD', rk .. ':shared_in', member)
  redis.call('SADD', ak .. ':shared', r)
else
  redis.call('SREM', rk .. ':shared_in', member)
  redis.call('SREM', ak .. ':shared', r)
end
return {'ok'}
"""

DELETE = """
local t, n, v, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ak = 'preft:adapter:' .. t .. '/' .. n
local vk, alk, tk = ak .. ':versions', ak .. ':aliases', 'preft:tenant:' .. t
if redis.call('EXISTS', ak) == 0 then return {'not_found'} end
local targets
if v == '' then
  targets = redis.call('HKEYS', vk)
else
  if redis.call('HEXISTS', vk, v) == 0 then return {'no_version'} end
  local aliases = redis.call('HGETALL', alk)
  local blocking = {}
  for i = 1, #aliases, 2 do
    if aliases[i] ~= 'latest' and aliases[i + 1] == v then table.insert(blocking, aliases[i]) end
  end
  if #blocking > 0 then return {'alias', table.concat(blocking, ', ')} end
  targets = {v}
end
for _, ver in ipairs(targets) do
  local m = cjson.decode(redis.call('HGET', vk, ver))
  for _, f in ipairs(m.files) do
    if redis.call('HINCRBY', 'preft:blobrefs', f.sha256, -1) <= 0 then
      redis.call('HDEL', 'preft:blobrefs', f.sha256)
    end
    redis.call('ZADD', 'preft:blobtouch', now, f.sha256)
  end
  redis.call('HINCRBY', tk, 'bytes_used', -m.size_bytes)
  redis.call('HDEL', vk, ver)
  redis.call('ZREM', 'preft:hot', t .. '/' .. n .. '@' .. ver)
end
if redis.call('HLEN', vk) == 0 then
  for _, s in ipairs(redis.call('SMEMBERS', ak .. ':shared')) do
    redis.call('SREM', 'preft:tenant:' .. s .. ':shared_in', t .. '/' .. n)
  end
  for _, s in ipairs(redis.call('SMEMBERS', ak .. ':offered')) do
    redis.call('SREM', 'preft:tenant:' .. s .. ':offers_in', t .. '/' .. n)
  end
  redis.call('DEL', ak, vk, alk, ak .. ':shared', ak .. ':offered')
  redis.call('SREM', tk .. ':adapters', n)
  redis.call('SREM', 'preft:adapters', t .. '/' .. n)
  redis.call('HINCRBY', tk, 'adapter_count', -1)
else
  local newest = 0
  for _, k in ipairs(redis.call('HKEYS', vk)) do newest = math.max(newest, tonumber(k)) end
  redis.call('HSET', alk, 'latest', newest)
end
local out = {'ok'}
for _, ver in ipairs(targets) do table.insert(out, ver) end
return out
"""

# Hotness in log2 space: a use at time t adds 2^(t/half_life) to a sum S, and the decayed score now is
# S * 2^(-now/half_life). Storing log2(S) keeps the numbers small forever; the ranking is the same.
RECORD_USE = """
local t, n, v, x = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('HEXISTS', 'preft:adapter:' .. t .. '/' .. n .. ':versions', v) == 0 then return {'not_found'} end
local member = t .. '/' .. n .. '@' .. v
local new = x
local old = redis.call('ZSCORE', 'preft:hot', member)
if old then
  old = tonumber(old)
  local hi, lo = math.max(old, x), math.min(old, x)
  new = hi + math.log(1 + 2 ^ (lo - hi)) / math.log(2)
end
redis.call('ZADD', 'preft:hot', new, member)
return {'ok', tostring(new)}
"""

# gc claims a blob for deletion only if no version references it and nothing touched it within the grace period;
# publish refuses digests being deleted, so a version can never point at a blob gc is removing.
GC_CLAIM = """
local d, cutoff = ARGV[1], tonumber(ARGV[2])
if redis.call('HEXISTS', 'preft:blobrefs', d) == 1 then return {'referenced'} end
local touched = redis.call('ZSCORE', 'preft:blobtouch', d)
if touched and tonumber(touched) > cutoff then return {'recent'} end
redis.call('SADD', 'preft:gc:deleting', d)
return {'ok'}
"""

GC_RELEASE = """
redis.call('SREM', 'preft:gc:deleting', ARGV[1])
redis.call('ZREM', 'preft:blobtouch', ARGV[1])
return {'ok'}
"""

# What an API key stands for, in one read (the registry's Authenticate RPC and the gateway both use it).
# KEYS[1] = preft:key:<sha256>. Returns {} for an unknown key, else {key id, tenant, revoked ms, expires ms,
# tenant state} where tenant state is 'ok', 'disabled' or 'missing'.
KEY_STATE = """
local key_id = redis.call('GET', KEYS[1])
if not key_id then return {} end
local k = redis.call('HMGET', 'preft:keyid:' .. key_id, 'tenant', 'revoked_unix_ms', 'expires_unix_ms')
if not k[1] then return {} end
local disabled = redis.call('HGET', 'preft:tenant:' .. k[1], 'disabled')
local state = 'ok'
if not disabled then state = 'missing' elseif disabled == '1' then state = 'disabled' end
return {key_id, k[1], k[2] or '0', k[3] or '0', state}
"""

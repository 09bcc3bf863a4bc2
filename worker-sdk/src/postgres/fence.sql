-- The storage fence as SQL functions: one implementation of its rules for
-- every client. The Rust store calls them; so can any program inside its
-- own transaction (psql from a shell task, psycopg from Python):
--
--   BEGIN;
--   SELECT batchlease_fence('<task uid>', <fencing token>);
--   UPDATE accounts SET ...;   -- your writes, fenced
--   COMMIT;                    -- refused past the attempt's deadline
--
-- The rules (the Rust store's, see postgres.rs):
-- * A task's row carries the highest token registered for it. A write of a
--   lower token is refused, however late it arrives; registration raises
--   the token before the handler runs.
-- * Every fenced write carries the attempt's deadline on the database
--   server's clock, and is refused once clock_timestamp() reaches it: at
--   the fence, and again at COMMIT (a deferred constraint trigger), so a
--   COMMIT whose packets sat in the network is refused by this clock.
-- * A fenced transaction holds the task's row lock until it ends, so no
--   newer attempt registers while its writes run; a successor waits at
--   most a third of the TTL for it (lock_timeout), and a holder paused
--   inside its transaction loses its session after a sixth of the TTL
--   (idle_in_transaction_session_timeout), before its lease could expire.
--
-- Refusals raise these SQLSTATEs (class LF, "lease fence": a class the SQL
-- standard leaves to implementations, as it does every class starting I-Z):
--   LF001  fenced: a newer attempt registered (DETAIL: its token)
--   LF002  deadline: the attempt's deadline passed on the server's clock
--   LF003  not registered: no attempt with this token registered the task
-- Only when missing: ALTER TABLE takes an ACCESS EXCLUSIVE lock even when
-- the column exists, and would queue every start behind the longest open
-- fenced transaction (and all task_state traffic behind itself).
DO $do$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                  WHERE table_schema = current_schema() AND table_name = 'task_state'
                    AND column_name = 'deadline') THEN
    ALTER TABLE task_state ADD COLUMN deadline timestamptz;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                  WHERE table_schema = current_schema() AND table_name = 'task_state'
                    AND column_name = 'ttl_ms') THEN
    ALTER TABLE task_state ADD COLUMN ttl_ms bigint;
  END IF;
END
$do$;

-- A session setting in milliseconds (0: none), and the stricter of it and
-- `ms`: a limit the client set itself is never loosened.
CREATE OR REPLACE FUNCTION batchlease_stricter(p_name text, p_ms bigint)
RETURNS bigint LANGUAGE sql STABLE AS $fn$
  SELECT CASE WHEN cur > 0 AND cur < p_ms THEN cur ELSE p_ms END
    FROM (SELECT setting::bigint AS cur FROM pg_settings WHERE name = p_name) s
$fn$;

-- Arms the rest of the transaction: the session limits from the deadline
-- and the TTL, and the deadline for the COMMIT-time check (the earliest,
-- when one transaction fences more than once).
CREATE OR REPLACE FUNCTION batchlease_arm(p_deadline timestamptz, p_ttl_ms bigint)
RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
  armed text := current_setting('batchlease.deadline', true);
  d numeric := extract(epoch FROM p_deadline);
  left_ms bigint;
BEGIN
  IF armed IS NOT NULL AND armed <> '' AND armed::numeric < d THEN
    d := armed::numeric;
  END IF;
  left_ms := greatest(1, floor((d - extract(epoch FROM clock_timestamp())) * 1000))::bigint;
  PERFORM set_config('batchlease.deadline', d::text, true);
  PERFORM set_config('statement_timeout', batchlease_stricter('statement_timeout', left_ms)::text, true);
  IF p_ttl_ms IS NOT NULL AND p_ttl_ms > 0 THEN
    PERFORM set_config('lock_timeout',
      batchlease_stricter('lock_timeout', greatest(1, p_ttl_ms / 3))::text, true);
    PERFORM set_config('idle_in_transaction_session_timeout',
      batchlease_stricter('idle_in_transaction_session_timeout', greatest(1, p_ttl_ms / 6))::text, true);
  END IF;
END
$fn$;

-- At COMMIT of a transaction that wrote the task row: refused once the
-- armed deadline passed on this server's clock.
CREATE OR REPLACE FUNCTION batchlease_check_deadline()
RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
  armed text := current_setting('batchlease.deadline', true);
BEGIN
  IF armed IS NOT NULL AND armed <> ''
     AND extract(epoch FROM clock_timestamp()) >= armed::numeric THEN
    RAISE EXCEPTION 'batchlease: the attempt''s deadline passed before COMMIT'
      USING ERRCODE = 'LF002', DETAIL = 'task ' || NEW.task_id;
  END IF;
  RETURN NULL;
END
$fn$;

DO $do$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger
                  WHERE tgname = 'batchlease_deadline' AND tgrelid = 'task_state'::regclass) THEN
    CREATE CONSTRAINT TRIGGER batchlease_deadline AFTER INSERT OR UPDATE ON task_state
      DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION batchlease_check_deadline();
  END IF;
END
$do$;

-- Registration, before the handler runs: raises the task's token to
-- p_token (never lowers it) and records the attempt's deadline and TTL.
-- Returns the commit that stuck, if any (committed_token NULL: none), or
-- raises LF001 (a newer attempt registered) or LF002 (too late).
-- Registering the same token again (an acknowledgement was lost) is
-- harmless and moves its deadline forward.
CREATE OR REPLACE FUNCTION batchlease_register(
  p_task text, p_token bigint, p_deadline timestamptz, p_ttl_ms bigint,
  OUT committed_token bigint, OUT payload jsonb)
LANGUAGE plpgsql AS $fn$
DECLARE
  r task_state%ROWTYPE;
  -- Never past what any lease of this TTL allows (2/3 of it from now).
  d timestamptz := least(p_deadline, clock_timestamp() + p_ttl_ms * 2 / 3 * interval '1 millisecond');
BEGIN
  IF clock_timestamp() >= p_deadline THEN
    RAISE EXCEPTION 'batchlease: attempt % of task % registered past its deadline', p_token, p_task
      USING ERRCODE = 'LF002';
  END IF;
  INSERT INTO task_state AS t (task_id, status, last_fencing_token, deadline, ttl_ms, updated_at)
  VALUES (p_task, 'RUNNING', p_token, d, p_ttl_ms, now())
  ON CONFLICT (task_id) DO UPDATE SET
      last_fencing_token = EXCLUDED.last_fencing_token,
      status = CASE WHEN t.committed_token IS NULL THEN 'RUNNING' ELSE t.status END,
      deadline = CASE WHEN t.last_fencing_token = EXCLUDED.last_fencing_token
                      THEN greatest(t.deadline, EXCLUDED.deadline) ELSE EXCLUDED.deadline END,
      ttl_ms = EXCLUDED.ttl_ms, updated_at = now()
    WHERE t.last_fencing_token <= EXCLUDED.last_fencing_token;
  SELECT * INTO r FROM task_state WHERE task_id = p_task;
  IF r.last_fencing_token > p_token THEN
    RAISE EXCEPTION 'batchlease: attempt % of task % is fenced: attempt % registered', p_token, p_task, r.last_fencing_token
      USING ERRCODE = 'LF001', DETAIL = r.last_fencing_token::text;
  END IF;
  committed_token := r.committed_token;
  payload := r.payload;
END
$fn$;

-- Moves a live attempt's deadline forward (after a renewal of its lease):
-- what batchlease_fence() without a deadline of its own checks. Raises
-- LF001 if a newer attempt registered, LF003 if this one never did,
-- LF002 if p_deadline already passed.
CREATE OR REPLACE FUNCTION batchlease_extend(p_task text, p_token bigint, p_deadline timestamptz)
RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
  current bigint;
  ttl bigint;
BEGIN
  IF clock_timestamp() >= p_deadline THEN
    RAISE EXCEPTION 'batchlease: attempt % of task % extended past its deadline', p_token, p_task
      USING ERRCODE = 'LF002';
  END IF;
  SELECT last_fencing_token, ttl_ms INTO current, ttl FROM task_state WHERE task_id = p_task;
  IF NOT FOUND OR current < p_token THEN
    RAISE EXCEPTION 'batchlease: attempt % of task % is not registered', p_token, p_task
      USING ERRCODE = 'LF003';
  END IF;
  IF current > p_token THEN
    RAISE EXCEPTION 'batchlease: attempt % of task % is fenced: attempt % registered', p_token, p_task, current
      USING ERRCODE = 'LF001', DETAIL = current::text;
  END IF;
  -- The attempt's own client may hold the row in a fenced transaction:
  -- wait for it only briefly (55P03 then; the caller tries again), never
  -- as long as a successor's registration would.
  PERFORM set_config('lock_timeout', greatest(1, least(coalesce(ttl, 3000) / 12, 1000))::text, true);
  UPDATE task_state
     SET deadline = greatest(deadline, least(p_deadline,
                      clock_timestamp() + coalesce(ttl, 0) * 2 / 3 * interval '1 millisecond')),
         updated_at = now()
   WHERE task_id = p_task AND last_fencing_token = p_token;
  IF NOT FOUND THEN
    -- Replaced while we waited for the row.
    RAISE EXCEPTION 'batchlease: attempt % of task % is fenced', p_token, p_task
      USING ERRCODE = 'LF001';
  END IF;
END
$fn$;

-- The fence for a client's own transaction: takes the task's row lock,
-- refuses a token that is not the one registered (LF001 newer, LF003
-- none) and a deadline that passed (LF002), and arms the rest of the
-- transaction (session limits; the deadline re-checked at COMMIT). The
-- deadline is p_deadline if given (an SDK that put its kill instant on
-- this server's clock), else the one the attempt's registration and
-- renewals recorded (batchlease_register, batchlease_extend). Several
-- fenced transactions of one attempt are fine; the commit that marks the
-- task done is batchlease_commit.
CREATE OR REPLACE FUNCTION batchlease_fence(p_task text, p_token bigint, p_deadline timestamptz DEFAULT NULL)
RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
  r task_state%ROWTYPE;
  ttl bigint;
  d timestamptz;
BEGIN
  -- Bound the wait for the row lock first (a paused holder of it).
  SELECT ttl_ms INTO ttl FROM task_state WHERE task_id = p_task;
  IF ttl IS NOT NULL AND ttl > 0 THEN
    PERFORM set_config('lock_timeout', greatest(1, ttl / 3)::text, true);
  END IF;
  SELECT * INTO r FROM task_state WHERE task_id = p_task FOR UPDATE;
  IF NOT FOUND OR r.last_fencing_token < p_token THEN
    RAISE EXCEPTION 'batchlease: attempt % of task % is not registered', p_token, p_task
      USING ERRCODE = 'LF003';
  END IF;
  IF r.last_fencing_token > p_token THEN
    RAISE EXCEPTION 'batchlease: attempt % of task % is fenced: attempt % registered', p_token, p_task, r.last_fencing_token
      USING ERRCODE = 'LF001', DETAIL = r.last_fencing_token::text;
  END IF;
  d := coalesce(p_deadline, r.deadline);
  IF d IS NULL OR clock_timestamp() >= d THEN
    RAISE EXCEPTION 'batchlease: attempt % of task % is past its deadline', p_token, p_task
      USING ERRCODE = 'LF002';
  END IF;
  PERFORM batchlease_arm(d, r.ttl_ms);
  -- Writes the row, so the COMMIT-time check runs for this transaction.
  UPDATE task_state SET updated_at = now() WHERE task_id = p_task;
END
$fn$;

-- The commit that marks the task done, at most once per task: the task
-- row carries p_payload and p_token as its committed token, if no newer
-- attempt registered and no commit stuck before. Returns false (nothing
-- written) when refused — a newer token, an earlier commit (maybe our
-- own, whose acknowledgement was lost: compare committed_token and
-- payload), or a deadline passed — and arms the rest of the transaction
-- when it wrote.
CREATE OR REPLACE FUNCTION batchlease_commit(
  p_task text, p_token bigint, p_payload jsonb, p_deadline timestamptz, p_ttl_ms bigint)
RETURNS boolean LANGUAGE plpgsql AS $fn$
BEGIN
  IF clock_timestamp() >= p_deadline THEN
    RETURN false;
  END IF;
  INSERT INTO task_state AS t (task_id, status, payload, last_fencing_token, committed_token,
                               deadline, ttl_ms, updated_at)
  VALUES (p_task, 'COMPLETED', p_payload, p_token, p_token, p_deadline, p_ttl_ms, now())
  ON CONFLICT (task_id) DO UPDATE SET status = 'COMPLETED', payload = EXCLUDED.payload,
      last_fencing_token = EXCLUDED.last_fencing_token,
      committed_token = EXCLUDED.committed_token, updated_at = now()
    WHERE t.last_fencing_token <= EXCLUDED.last_fencing_token AND t.committed_token IS NULL;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  -- The upsert may have waited for the row lock past the deadline.
  IF clock_timestamp() >= p_deadline THEN
    RAISE EXCEPTION 'batchlease: attempt % of task % committed past its deadline', p_token, p_task
      USING ERRCODE = 'LF002';
  END IF;
  PERFORM batchlease_arm(p_deadline, p_ttl_ms);
  RETURN true;
END
$fn$;

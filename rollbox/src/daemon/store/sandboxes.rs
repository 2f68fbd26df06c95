//! Queries of the `sandboxes` table (and `sandbox_sources`, where a sandbox came from).

use rusqlite::{params, OptionalExtension};

use super::super::api::{ListQuery, Sandbox, State};
use super::rows::{SandboxRow, UsageRow, COLUMNS};
use super::{Inserted, Store, StoreError, RUN_MS_UNTIL_NOW, SQL_NOW_MS};

/// The sandbox whose (tenant-scoped) idempotency key `row` carries, if `row` has one.
fn with_key(conn: &rusqlite::Connection, row: &SandboxRow) -> Result<Option<Sandbox>, StoreError> {
    let Some(key) = &row.idempotency_key else {
        return Ok(None);
    };
    conn.query_row(
        &format!("SELECT {COLUMNS} FROM sandboxes WHERE idempotency_key = ?1"),
        params![key],
        SandboxRow::read,
    )
    .optional()?
    .map(|raw| raw.into_model().map(|(_, s)| s))
    .transpose()
}

impl Store {
    /// Inserts a new sandbox row, unless its idempotency key is taken (in one transaction, so
    /// two racing creates with one key make one row).
    pub fn insert_sandbox(&mut self, sandbox: &Sandbox) -> Result<Inserted, StoreError> {
        let row = SandboxRow::of(sandbox)?;
        let tx = self.conn.transaction()?;
        if let Some(existing) = with_key(&tx, &row)? {
            return Ok(Inserted::Existing(Box::new(existing)));
        }
        tx.execute(
            "INSERT INTO sandboxes (id, idempotency_key, template, state, vcpus, memory_mib, \
             labels, metadata, created_at_ms, expires_at_ms, idle_ttl_s, last_active_at_ms, \
             pid, pid_start_time, dir, ended_at_ms, end_reason, env, cpu_limit, deterministic, \
             on_timeout, auto_resume, ttl_s, tenant, volumes, gpus, network) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, \
             ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27)",
            params![
                row.id,
                row.idempotency_key,
                row.template,
                row.state,
                row.vcpus,
                row.memory_mib,
                row.labels,
                row.metadata,
                row.created_at_ms,
                row.expires_at_ms,
                row.idle_ttl_s,
                row.last_active_at_ms,
                row.pid,
                row.pid_start_time,
                row.dir,
                row.ended_at_ms,
                row.end_reason,
                row.env,
                row.cpu_limit,
                row.deterministic,
                row.on_timeout,
                row.auto_resume,
                row.ttl_s,
                row.tenant,
                row.volumes,
                row.gpus,
                row.network,
            ],
        )?;
        tx.commit()?;
        Ok(Inserted::New)
    }

    pub fn sandbox(&self, id: &str) -> Result<Option<Sandbox>, StoreError> {
        let raw = self
            .conn
            .query_row(
                &format!("SELECT {COLUMNS} FROM sandboxes WHERE id = ?1"),
                params![id],
                SandboxRow::read,
            )
            .optional()?;
        raw.map(|r| r.into_model().map(|(_, s)| s)).transpose()
    }

    /// One page of sandboxes, oldest first, and the next page's token.
    pub fn list(&self, query: &ListQuery) -> Result<(Vec<Sandbox>, Option<String>), StoreError> {
        let mut sql = format!("SELECT {COLUMNS} FROM sandboxes WHERE seq > ?");
        let mut values: Vec<rusqlite::types::Value> = vec![query.after.unwrap_or(0).into()];
        if !query.ids.is_empty() {
            let marks = vec!["?"; query.ids.len()].join(", ");
            sql.push_str(&format!(" AND id IN ({marks})"));
            values.extend(query.ids.iter().map(|id| id.clone().into()));
        }
        if let Some(tenant) = &query.tenant {
            sql.push_str(" AND tenant = ?");
            values.push(tenant.clone().into());
        }
        if let Some(state) = query.state {
            sql.push_str(" AND state = ?");
            values.push(state.as_str().to_string().into());
        } else if !query.ids.is_empty() {
            // Sandboxes asked for by id show in any state.
        } else {
            // Ended sandboxes only show when asked for by state.
            sql.push_str(" AND state IN ('creating', 'running', 'paused')");
        }
        for (key, value) in &query.labels {
            // The JSON path is a bound parameter, never SQL text; the validators allow only
            // plain keys (no quotes), so the quoted path names exactly that key.
            sql.push_str(" AND json_extract(labels, ?) = ?");
            values.push(format!("$.\"{key}\"").into());
            values.push(value.clone().into());
        }
        sql.push_str(" ORDER BY seq LIMIT ?");
        values.push((i64::from(query.limit) + 1).into());
        let mut statement = self.conn.prepare(&sql)?;
        let raws = statement
            .query_map(rusqlite::params_from_iter(values), SandboxRow::read)?
            .collect::<rusqlite::Result<Vec<SandboxRow>>>()?;
        let mut rows = raws
            .into_iter()
            .map(SandboxRow::into_model)
            .collect::<Result<Vec<_>, _>>()?;
        let limit = usize::try_from(query.limit).unwrap_or(usize::MAX);
        let next = if rows.len() > limit {
            rows.truncate(limit);
            rows.last().map(|(seq, _)| seq.to_string())
        } else {
            None
        };
        Ok((rows.into_iter().map(|(_, s)| s).collect(), next))
    }

    /// Sandboxes that may have a VMM process (creating, running, paused).
    pub fn live(&self) -> Result<Vec<Sandbox>, StoreError> {
        let mut statement = self.conn.prepare(&format!(
            "SELECT {COLUMNS} FROM sandboxes WHERE state IN ('creating', 'running', 'paused') ORDER BY seq"
        ))?;
        let raws = statement
            .query_map([], SandboxRow::read)?
            .collect::<rusqlite::Result<Vec<SandboxRow>>>()?;
        raws.into_iter()
            .map(|r| r.into_model().map(|(_, s)| s))
            .collect()
    }

    /// The sandbox an earlier create with `sandbox`'s idempotency key made, if any.
    pub fn created_with_key(&self, sandbox: &Sandbox) -> Result<Option<Sandbox>, StoreError> {
        with_key(&self.conn, &SandboxRow::of(sandbox)?)
    }

    /// How many sandboxes are live (creating, running or paused) and the guest memory they
    /// hold, in MiB: what admission counts against `--max-sandboxes` and `--memory-budget-mib`.
    pub fn live_totals(&self) -> Result<(u64, u64), StoreError> {
        Ok(self
            .conn
            .query_row(
                "SELECT COUNT(*), COALESCE(SUM(memory_mib), 0) FROM sandboxes \
             WHERE state IN ('creating', 'running', 'paused')",
                [],
                |row| Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?)),
            )
            .map(|(count, mib)| (count.max(0) as u64, mib.max(0) as u64))?)
    }

    /// Creating -> running with its process; false if the sandbox left `creating` meanwhile.
    pub fn set_running(&self, id: &str, pid: u32, start_time: u64) -> Result<bool, StoreError> {
        Ok(self.conn.execute(
            &format!(
                "UPDATE sandboxes SET state = 'running', pid = ?2, pid_start_time = ?3, \
                 running_since_ms = {SQL_NOW_MS} WHERE id = ?1 AND state = 'creating'"
            ),
            params![id, pid, start_time],
        )? == 1)
    }

    /// Records sandbox `id`'s network: the one made for it while it is `creating`
    /// (`creating_only`), or a live sandbox's changed one (a new egress policy). False if it
    /// is not in such a state (deleted meanwhile).
    pub fn set_network(
        &self,
        id: &str,
        network: &super::super::api::SandboxNetwork,
        creating_only: bool,
    ) -> Result<bool, StoreError> {
        let json = super::to_json(network, "network")?;
        let states = if creating_only {
            "('creating')"
        } else {
            "('creating', 'running', 'paused')"
        };
        Ok(self.conn.execute(
            &format!("UPDATE sandboxes SET network = ?2 WHERE id = ?1 AND state IN {states}"),
            params![id, json],
        )? == 1)
    }

    /// Moves a live sandbox from `from` to `to`; false if it was not in `from`.
    pub fn transition(&self, id: &str, from: State, to: State) -> Result<bool, StoreError> {
        Ok(self.conn.execute(
            &format!(
                "UPDATE sandboxes SET state = ?3, {RUN_MS_UNTIL_NOW}, \
                 running_since_ms = CASE WHEN ?3 = 'running' THEN {SQL_NOW_MS} END \
                 WHERE id = ?1 AND state = ?2"
            ),
            params![id, from.as_str(), to.as_str()],
        )? == 1)
    }

    /// Ends a live sandbox; false if it had ended already.
    pub fn end(
        &self,
        id: &str,
        state: State,
        reason: &str,
        now_ms: u64,
    ) -> Result<bool, StoreError> {
        Ok(self.conn.execute(
            "UPDATE sandboxes SET state = ?2, end_reason = ?3, ended_at_ms = ?4, \
             run_ms = run_ms + MAX(0, ?4 - COALESCE(running_since_ms, ?4)), \
             running_since_ms = NULL \
             WHERE id = ?1 AND state IN ('creating', 'running', 'paused')",
            params![id, state.as_str(), reason, now_ms],
        )? == 1)
    }

    /// Records an API call on the sandbox (for the idle TTL).
    pub fn touch(&self, id: &str, now_ms: u64) -> Result<(), StoreError> {
        self.conn.execute(
            "UPDATE sandboxes SET last_active_at_ms = ?2 WHERE id = ?1",
            params![id, now_ms],
        )?;
        Ok(())
    }

    /// Records the snapshot a sandbox was restored or reset from.
    pub fn set_source(&self, sandbox: &str, snapshot: &str) -> Result<(), StoreError> {
        self.conn.execute(
            "INSERT INTO sandbox_sources (sandbox, snapshot) VALUES (?1, ?2) \
             ON CONFLICT(sandbox) DO UPDATE SET snapshot = ?2",
            params![sandbox, snapshot],
        )?;
        Ok(())
    }

    pub fn source(&self, sandbox: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .conn
            .query_row(
                "SELECT snapshot FROM sandbox_sources WHERE sandbox = ?1",
                params![sandbox],
                |row| row.get(0),
            )
            .optional()?)
    }

    /// Points a live sandbox at a new VMM (after a reset); false if it is not live.
    pub fn set_vmm(&self, id: &str, pid: u32, start_time: u64) -> Result<bool, StoreError> {
        Ok(self.conn.execute(
            &format!(
                "UPDATE sandboxes SET pid = ?2, pid_start_time = ?3, state = 'running', \
                 running_since_ms = COALESCE(running_since_ms, {SQL_NOW_MS}) \
                 WHERE id = ?1 AND state IN ('running', 'paused')"
            ),
            params![id, pid, start_time],
        )? == 1)
    }

    /// Sets a live sandbox's expiry; false if it is not live.
    pub fn set_expiry(&self, id: &str, expires_at_ms: u64) -> Result<bool, StoreError> {
        Ok(self.conn.execute(
            "UPDATE sandboxes SET expires_at_ms = ?2 \
             WHERE id = ?1 AND state IN ('creating', 'running', 'paused')",
            params![id, expires_at_ms],
        )? == 1)
    }

    /// Usage columns of sandbox `id`, or (None) of every sandbox live or ended since
    /// `ended_since_ms`.
    pub fn usage_rows(
        &self,
        id: Option<&str>,
        ended_since_ms: u64,
    ) -> Result<Vec<UsageRow>, StoreError> {
        let mut statement = self.conn.prepare(
            "SELECT id, run_ms, running_since_ms, cpu_ms FROM sandboxes \
             WHERE (?1 IS NULL AND (ended_at_ms IS NULL OR ended_at_ms >= ?2)) OR id = ?1 \
             ORDER BY seq",
        )?;
        let found = statement
            .query_map(params![id, ended_since_ms], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, u64>(1)?,
                    row.get::<_, Option<u64>>(2)?,
                    row.get::<_, u64>(3)?,
                ))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let mut rows = Vec::new();
        for (id, run_ms, running_since_ms, cpu_ms) in found {
            if let Some(sandbox) = self.sandbox(&id)? {
                rows.push(UsageRow {
                    sandbox,
                    run_ms,
                    running_since_ms,
                    cpu_ms,
                });
            }
        }
        Ok(rows)
    }

    /// Adds an ended VMM's CPU time to the sandbox's.
    pub fn add_cpu_ms(&self, id: &str, ms: u64) -> Result<(), StoreError> {
        self.conn.execute(
            "UPDATE sandboxes SET cpu_ms = cpu_ms + ?2 WHERE id = ?1",
            params![id, ms],
        )?;
        Ok(())
    }

    /// Sandboxes by state, every state listed.
    pub fn state_counts(&self) -> Result<Vec<(State, u64)>, StoreError> {
        let mut out = Vec::new();
        for state in State::ALL {
            let count: Option<u64> = self
                .conn
                .query_row(
                    "SELECT COUNT(*) FROM sandboxes WHERE state = ?1",
                    params![state.as_str()],
                    |row| row.get(0),
                )
                .optional()?;
            out.push((state, count.unwrap_or(0)));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    use super::*;

    fn sandbox(id: &str, key: Option<&str>, labels: &[(&str, &str)]) -> Sandbox {
        Sandbox {
            id: id.into(),
            template: "t".into(),
            state: State::Running,
            vcpus: 1,
            memory_mib: 32,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            metadata: BTreeMap::new(),
            idempotency_key: key.map(str::to_string),
            created_at_ms: 1,
            expires_at_ms: 2,
            idle_ttl_s: None,
            last_active_at_ms: 1,
            pid: None,
            pid_start_time: None,
            dir: PathBuf::from("/nowhere"),
            ended_at_ms: None,
            end_reason: None,
            env: BTreeMap::new(),
            cpu_limit: None,
            deterministic: false,
            on_timeout: super::super::super::api::OnTimeout::Kill,
            auto_resume: false,
            ttl_s: 1,
            tenant: None,
            volumes: Vec::new(),
            gpus: Vec::new(),
            network: None,
        }
    }

    #[test]
    fn sources_count_for_live_sandboxes_and_creating_ones_apart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = Store::open(&dir.path().join("state.db")).expect("open");
        let creating = Sandbox {
            state: State::Creating,
            ..sandbox("creating", None, &[])
        };
        for (s, snapshot) in [
            (creating, "snap-a"),
            (sandbox("running", None, &[]), "snap-b"),
            (sandbox("ended", None, &[]), "snap-c"),
        ] {
            store.insert_sandbox(&s).expect("insert");
            store.set_source(&s.id, snapshot).expect("source");
        }
        store.end("ended", State::Deleted, "test", 3).expect("end");
        let set = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            store.sources_of_live().expect("live"),
            set(&["snap-a", "snap-b"])
        );
        assert_eq!(
            store.sources_of_creating().expect("creating"),
            set(&["snap-a"])
        );
    }

    #[test]
    fn idempotency_label_filter_and_pages() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = Store::open(&dir.path().join("state.db")).expect("open");
        assert!(matches!(
            store.insert_sandbox(&sandbox("a", Some("k"), &[("run", "1")])),
            Ok(Inserted::New)
        ));
        match store.insert_sandbox(&sandbox("b", Some("k"), &[])) {
            Ok(Inserted::Existing(s)) => assert_eq!(s.id, "a"),
            _ => panic!("second insert with one key"),
        }
        for id in ["c", "d", "e"] {
            assert!(matches!(
                store.insert_sandbox(&sandbox(id, None, &[("run", "1"), ("app.io/name", id)])),
                Ok(Inserted::New)
            ));
        }
        let dotted = ListQuery {
            labels: vec![("app.io/name".into(), "c".into())],
            limit: 10,
            ..ListQuery::default()
        };
        let (page, _) = store.list(&dotted).expect("list");
        assert_eq!(
            page.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["c"]
        );
        // Keys that would be SQL if formatted into the statement match nothing (or fail as a
        // bad JSON path); the table is still there.
        for evil in [
            "x\"') = 1 OR 1=1 --",
            "x\"') IS NULL; DROP TABLE sandboxes; --",
            "x\"') IN (WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n+1 FROM r) SELECT n FROM r) --",
        ] {
            let query = ListQuery {
                labels: vec![(evil.into(), "1".into())],
                limit: 10,
                ..ListQuery::default()
            };
            if let Ok((page, _)) = store.list(&query) {
                assert!(page.is_empty(), "{evil:?} matched {}", page.len());
            }
        }
        assert_eq!(store.list(&dotted).expect("list").0.len(), 1);
        assert!(store.end("d", State::Deleted, "gone", 5).expect("end"));
        assert!(!store
            .end("d", State::Deleted, "gone", 6)
            .expect("end again"));
        let mut query = ListQuery {
            labels: vec![("run".into(), "1".into())],
            limit: 2,
            ..ListQuery::default()
        };
        let (page, next) = store.list(&query).expect("list");
        assert_eq!(
            page.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["a", "c"]
        );
        query.after = next.and_then(|t| t.parse().ok());
        let (page, next) = store.list(&query).expect("list");
        assert_eq!(
            page.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["e"]
        );
        assert_eq!(next, None);
        query.state = Some(State::Deleted);
        query.after = None;
        let (page, _) = store.list(&query).expect("list");
        assert_eq!(
            page.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["d"]
        );
    }

    #[test]
    fn idempotency_keys_and_lists_are_per_tenant() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = Store::open(&dir.path().join("state.db")).expect("open");
        let of = |id: &str, tenant: Option<&str>| Sandbox {
            tenant: tenant.map(str::to_string),
            ..sandbox(id, Some("k"), &[])
        };
        for (id, tenant) in [("a", Some("a")), ("b", Some("b")), ("admin", None)] {
            assert!(
                matches!(store.insert_sandbox(&of(id, tenant)), Ok(Inserted::New)),
                "{id}"
            );
        }
        match store.insert_sandbox(&of("a2", Some("a"))) {
            Ok(Inserted::Existing(s)) => {
                assert_eq!((s.id.as_str(), s.tenant.as_deref()), ("a", Some("a")))
            }
            _ => panic!("a's key again"),
        }
        let b = store.sandbox("b").expect("read").expect("b");
        assert_eq!(
            (b.idempotency_key.as_deref(), b.tenant.as_deref()),
            (Some("k"), Some("b"))
        );
        let query = ListQuery {
            tenant: Some("b".into()),
            limit: 10,
            ..ListQuery::default()
        };
        let (page, _) = store.list(&query).expect("list");
        assert_eq!(
            page.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["b"]
        );
    }
}

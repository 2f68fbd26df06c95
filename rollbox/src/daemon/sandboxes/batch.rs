//! Batches: create N sandboxes of one spec (all admitted at once, or a 429 and none), and end
//! every sandbox a query of ids or labels names.

use std::sync::Arc;

use super::super::api::{ApiError, CreateSandbox, ForkResult, ListQuery, Reply, State};
use super::super::util::internal;
use super::Sandboxes;

impl Sandboxes {
    /// `count` creates, each succeeding or failing on its own. They take `count` places among
    /// the pending creates at once: when there are not that many free, the answer is 429 and
    /// nothing is created.
    pub async fn create_batch(
        &self,
        count: u32,
        request: CreateSandbox,
    ) -> Result<Reply, ApiError> {
        let limit = self.options.max_pending_creates;
        if usize::try_from(count).unwrap_or(usize::MAX) > limit {
            return Err(ApiError::BadRequest(format!(
                "count: {count} is over this server's --max-pending-creates {limit}; send smaller batches"
            )));
        }
        let prepared = self.prepare(&request)?;
        let memory_mib = prepared.snapshot.as_ref().map_or(
            request.memory_mib.unwrap_or(prepared.template.memory_mib),
            |s| s.memory_mib,
        );
        self.check_room(count, memory_mib)?;
        let Ok(_permits) = Arc::clone(&self.pending).try_acquire_many_owned(count) else {
            self.counters.refused();
            let in_flight = limit.saturating_sub(self.pending.available_permits());
            return Err(ApiError::Overloaded(in_flight));
        };
        let creates = (0..count).map(|index| {
            let mut item = request.clone();
            item.idempotency_key = request
                .idempotency_key
                .as_ref()
                .map(|key| format!("{key}/{index}"));
            let prepared = &prepared;
            async move { self.admitted(item, prepared).await }
        });
        let results = futures_util::future::join_all(creates)
            .await
            .into_iter()
            .map(ForkResult::of)
            .collect();
        Ok(Reply::Forked(results))
    }

    /// Ends every live sandbox, for `reason` (a drain's deadline); failures are logged.
    pub async fn end_all_live(&self, reason: &str) {
        let live = match self.db.lock().live() {
            Ok(live) => live,
            Err(e) => {
                log::error!("{reason}: listing the live sandboxes: {e}");
                return;
            }
        };
        let ends = live.iter().map(|s| self.end(&s.id, State::Deleted, reason));
        for (sandbox, result) in live.iter().zip(futures_util::future::join_all(ends).await) {
            match result {
                Ok(()) => log::info!("sandbox {}: {reason}", sandbox.id),
                Err(e) => log::error!("sandbox {}: {reason}: {e}", sandbox.id),
            }
        }
    }

    /// Ends every live sandbox `query` matches; answers the ids it ended.
    pub async fn delete_matching(&self, mut query: ListQuery) -> Result<Reply, ApiError> {
        let mut live = Vec::new();
        query.limit = 1000;
        loop {
            let (page, next) = self.db.lock().list(&query).map_err(internal)?;
            live.extend(page.into_iter().filter(|s| s.state.is_live()).map(|s| s.id));
            match next.and_then(|t| t.parse().ok()) {
                Some(after) => query.after = Some(after),
                None => break,
            }
        }
        let ends = live
            .iter()
            .map(|id| self.end(id, State::Deleted, "deleted by the API (DELETE /sandboxes)"));
        for (id, result) in live.iter().zip(futures_util::future::join_all(ends).await) {
            result.map_err(|e| ApiError::Internal(format!("ending sandbox {id}: {e}")))?;
        }
        Ok(Reply::Deleted(live))
    }
}

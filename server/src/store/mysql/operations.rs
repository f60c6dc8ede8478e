//! The operator's queries and actions on MySQL.

use std::time::Duration;

use super::super::operations::{Operations, RecordView, Standing, Tally, view_of};
use super::super::{StoreError, StoredAnswer, encode_headers};
use super::{MySqlStore, micros};

/// The columns of a record's view ([`view_of`]).
macro_rules! view_columns {
    () => {
        concat!(
            "SELECT CONVERT(scope USING utf8mb4) AS scope, CONVERT(`key` USING utf8mb4) AS `key`,
                    status, step, steps, request, attempt, generation, note,
                    CAST(response_status AS SIGNED) AS response_status, ",
            epoch_ms!("created_at"),
            " AS created_ms, ",
            epoch_ms!("expires_at"),
            " AS expires_ms, ",
            epoch_ms!("locked_until"),
            " AS lease_ms, ",
            left_ms!("locked_until"),
            " AS lease_left FROM safe_retry_outcomes "
        )
    };
}

impl Operations for MySqlStore {
    async fn records(&self, standing: Standing, limit: u32) -> Result<Vec<RecordView>, StoreError> {
        let sql = match standing {
            Standing::Running => concat!(
                view_columns!(),
                "WHERE status = 'in_progress' AND locked_until > ",
                now!(),
                " ORDER BY id LIMIT ?"
            ),
            Standing::Stalled => concat!(
                view_columns!(),
                "WHERE status = 'in_progress' AND locked_until <= ",
                now!(),
                " AND step IS NULL ORDER BY id LIMIT ?"
            ),
            Standing::Parked => concat!(
                view_columns!(),
                "WHERE status = 'in_progress' AND locked_until <= ",
                now!(),
                " AND step IS NOT NULL ORDER BY id LIMIT ?"
            ),
            Standing::Failed => concat!(
                view_columns!(),
                "WHERE status = 'failed' ORDER BY id LIMIT ?"
            ),
            Standing::Completed => concat!(
                view_columns!(),
                "WHERE status = 'completed' ORDER BY id LIMIT ?"
            ),
        };
        let rows = sqlx::query(sql)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(view_of).collect()
    }

    async fn inspect(&self, scope: &str, key: &str) -> Result<Option<RecordView>, StoreError> {
        let row = sqlx::query(concat!(view_columns!(), "WHERE scope = ? AND `key` = ?"))
            .bind(scope.as_bytes())
            .bind(key.as_bytes())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(view_of).transpose()
    }

    async fn tally(&self) -> Result<Tally, StoreError> {
        let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(concat!(
            "SELECT status, CAST(COALESCE(locked_until > ",
            now!(),
            ", 0) AS SIGNED) AS live, CAST(step IS NOT NULL AS SIGNED) AS stepped,
                    CAST(COUNT(*) AS SIGNED)
             FROM safe_retry_outcomes GROUP BY status, live, stepped"
        ))
        .fetch_all(&self.pool)
        .await?;
        Ok(Tally::of_rows(
            rows.into_iter()
                .map(|(status, live, stepped, n)| (status, live, stepped == 1, n))
                .collect(),
        ))
    }

    async fn retry_now(&self, scope: &str, key: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(concat!(
            "UPDATE safe_retry_outcomes SET locked_until = ",
            now!(),
            ", generation = attempt + 1
             WHERE scope = ? AND `key` = ? AND status = 'in_progress' AND locked_until <= ",
            now!()
        ))
        .bind(scope.as_bytes())
        .bind(key.as_bytes())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn abandon_record(
        &self,
        scope: &str,
        key: &str,
        reason: &str,
        answer: &StoredAnswer,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(concat!(
            "UPDATE safe_retry_outcomes
             SET status = 'failed', locked_until = NULL, request = NULL, note = ?,
                 response_status = ?, response_headers = ?, response_body = ?,
                 expires_at = ",
            later!(),
            " WHERE scope = ? AND `key` = ?
               AND (status = 'failed' OR (status = 'in_progress' AND locked_until <= ",
            now!(),
            "))"
        ))
        .bind(reason)
        .bind(i32::from(answer.status.as_u16()))
        .bind(encode_headers(&answer.headers))
        .bind(answer.body.as_deref())
        .bind(micros(retention))
        .bind(scope.as_bytes())
        .bind(key.as_bytes())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}

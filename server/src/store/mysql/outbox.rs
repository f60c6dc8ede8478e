//! The outbox on MySQL: staged in the handler's transaction, taken with `SKIP LOCKED`, settled
//! under the delivery's fence.

use std::time::Duration;

use sqlx::Row;
use sqlx::mysql::MySql;

use super::super::{
    Outbox, OutboxMessage, Settle, StagedMessage, StoreError, encode_headers, message_of,
    settle_columns,
};
use super::{MAX_MESSAGE_ID, MySqlStore, micros};

impl Outbox for MySqlStore {
    async fn stage(
        &self,
        tx: &mut Self::Tx,
        message: &StagedMessage<'_>,
    ) -> Result<(), StoreError> {
        if message.id.len() > MAX_MESSAGE_ID {
            return Err(StoreError::new(format!(
                "the MySQL store keeps outbox message ids of at most {MAX_MESSAGE_ID} bytes; this one is {}",
                message.id.len()
            )));
        }
        // `ON DUPLICATE KEY UPDATE id = id`: a message already staged is left as it is (not
        // `INSERT IGNORE`, which would turn every other error into a warning too).
        sqlx::query(concat!(
            "INSERT INTO safe_retry_outbox
                (id, method, url, headers, body, status, available_at, created_at)
             VALUES (?, ?, ?, ?, ?, 'pending', ",
            now!(),
            ", ",
            now!(),
            ") ON DUPLICATE KEY UPDATE id = id"
        ))
        .bind(message.id.as_bytes())
        .bind(message.method)
        .bind(message.url)
        .bind(encode_headers(message.headers))
        .bind(message.body)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn take_messages(
        &self,
        batch: u32,
        lease: Duration,
    ) -> Result<Vec<OutboxMessage>, StoreError> {
        // SKIP LOCKED: relays on every server take disjoint batches without waiting; the rows
        // chosen stay locked until their deliveries are counted.
        let mut tx = self.pool.begin().await?;
        let rows = sqlx::query(concat!(
            "SELECT CONVERT(id USING utf8mb4) AS id, method, url, headers, body,
                    deliveries + 1 AS deliveries, id AS raw_id
             FROM safe_retry_outbox
             WHERE status = 'pending' AND available_at <= ",
            now!(),
            " ORDER BY available_at LIMIT ? FOR UPDATE SKIP LOCKED"
        ))
        .bind(i64::from(batch))
        .fetch_all(&mut *tx)
        .await?;
        if !rows.is_empty() {
            let mut update = sqlx::QueryBuilder::<MySql>::new(concat!(
                "UPDATE safe_retry_outbox SET deliveries = deliveries + 1, available_at = ",
                now!(),
                " + INTERVAL "
            ));
            update.push_bind(micros(lease));
            update.push(" MICROSECOND WHERE id IN (");
            let mut list = update.separated(", ");
            for row in &rows {
                list.push_bind(row.try_get::<Vec<u8>, _>("raw_id")?);
            }
            update.push(")");
            update.build().execute(&mut *tx).await?;
        }
        tx.commit().await?;
        rows.iter().map(message_of).collect()
    }

    async fn settle(&self, id: &str, delivery: i64, settle: &Settle) -> Result<bool, StoreError> {
        let (status, answer, error, keep, after) = settle_columns(settle);
        let done = sqlx::query(concat!(
            "UPDATE safe_retry_outbox
             SET status = ?, answer_status = COALESCE(?, answer_status), last_error = ?,
                 expires_at = ",
            later!(),
            ", available_at = COALESCE(",
            later!(),
            ", available_at)
             WHERE id = ? AND deliveries = ? AND status = 'pending'"
        ))
        .bind(status)
        .bind(answer)
        .bind(error)
        .bind(keep.map(|ms| micros(Duration::from_millis(ms.max(0) as u64))))
        .bind(after.map(|ms| micros(Duration::from_millis(ms.max(0) as u64))))
        .bind(id.as_bytes())
        .bind(delivery)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}

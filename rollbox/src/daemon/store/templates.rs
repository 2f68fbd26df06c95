//! Queries of the `templates` table.

use rusqlite::{params, OptionalExtension};

use super::super::api::Template;
use super::rows::TemplateRow;
use super::{json_column, to_json, Store, StoreError};

impl Store {
    /// Adds a template; false if the name is taken.
    pub fn add_template(&self, template: &Template) -> Result<bool, StoreError> {
        let spec = to_json(&TemplateRow::from(template), "spec")?;
        let changed = self.conn.execute(
            "INSERT INTO templates (name, spec) VALUES (?1, ?2) ON CONFLICT(name) DO NOTHING",
            params![template.name, spec],
        )?;
        Ok(changed == 1)
    }

    pub fn template(&self, name: &str) -> Result<Option<Template>, StoreError> {
        let spec: Option<String> = self
            .conn
            .query_row(
                "SELECT spec FROM templates WHERE name = ?1",
                params![name],
                |row| row.get(0),
            )
            .optional()?;
        spec.map(|s| json_column::<TemplateRow>(&s, "spec").map(Template::from))
            .transpose()
    }

    pub fn templates(&self) -> Result<Vec<Template>, StoreError> {
        let mut statement = self
            .conn
            .prepare("SELECT spec FROM templates ORDER BY name")?;
        let specs = statement
            .query_map([], |row| row.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<String>>>()?;
        specs
            .iter()
            .map(|s| json_column::<TemplateRow>(s, "spec").map(Template::from))
            .collect()
    }

    /// Replaces a template's spec (its boot snapshot once taken).
    pub fn update_template(&self, template: &Template) -> Result<bool, StoreError> {
        let spec = to_json(&TemplateRow::from(template), "spec")?;
        let changed = self.conn.execute(
            "UPDATE templates SET spec = ?2 WHERE name = ?1",
            params![template.name, spec],
        )?;
        Ok(changed == 1)
    }

    /// Removes a template; false if there was none.
    pub fn remove_template(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self
            .conn
            .execute("DELETE FROM templates WHERE name = ?1", params![name])?
            == 1)
    }

    /// The template whose boot snapshot `snapshot` is, if any.
    pub fn boot_snapshot_owner(&self, snapshot: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .templates()?
            .into_iter()
            .find(|t| t.boot_snapshot.as_deref() == Some(snapshot))
            .map(|t| t.name))
    }
}
